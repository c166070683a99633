"""A duplicate id on one WebSocket (issue 26): the second chat is refused, the first one keeps
running to its own ``done``."""

from __future__ import annotations

from starlette.testclient import TestClient

from streamkv.engine.async_engine import AsyncEngine
from streamkv.entrypoints.server.app import ServerConfig, build_app
from streamkv.entrypoints.server.security import HostPolicy
from tests.entrypoints.fake_engine import FakeEngine

CHAT = [{"role": "user", "content": "x"}]


def test_a_duplicate_id_leaves_the_first_generation_running() -> None:
    engine = AsyncEngine(lambda: FakeEngine(step_delay=0.01))
    app = build_app(engine, ServerConfig(model_name="fake", hosts=HostPolicy.build("testserver")))
    with TestClient(app) as client, client.websocket_connect("/v1/chat/ws") as ws:
        for mid in ("a", 1):
            ws.send_json(
                {"type": "chat", "id": mid, "messages": CHAT, "params": {"max_tokens": 30}}
            )
            first = ws.receive_json()
            assert first["type"] == "delta" and first["id"] == mid
            ws.send_json({"type": "chat", "id": mid, "messages": CHAT, "params": {"max_tokens": 3}})
            msgs = []
            while not msgs or msgs[-1]["type"] != "done":
                msgs.append(ws.receive_json())
            errors = [m for m in msgs if m["type"] == "error"]
            assert len(errors) == 1 and errors[0]["error"]["code"] == "duplicate_id"
            text = first["text"] + "".join(m["text"] for m in msgs if m["type"] == "delta")
            assert msgs[-1]["id"] == mid and msgs[-1]["finish_reason"] == "length"
            assert msgs[-1]["usage"]["completion_tokens"] == 30 and len(text) == 30
