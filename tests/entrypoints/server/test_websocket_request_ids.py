"""The WebSocket chat on the fake engine: a generation tells the client its engine request id
(the page's KV view marks its own reply by it), a client's ``params.request_id`` names it as
on HTTP, and an error leaves a warning with that id in the server log (issue 29)."""

from __future__ import annotations

import logging

import pytest

from streamkv.entrypoints.server.kv_view import _Viewer
from tests.entrypoints.fake_engine import CRASH_TOKEN, FakeEngine, make_client, wait_healthy

CHAT = [{"role": "user", "content": "hi"}]
LOGGER = "streamkv.entrypoints.server.websocket"


@pytest.fixture(scope="module")
def fake():
    return FakeEngine()


@pytest.fixture(scope="module")
def client(fake):
    with make_client(fake) as c:
        wait_healthy(c)
        yield c


def run_chat(ws, mid, params: dict, messages=CHAT) -> list[dict]:
    ws.send_json({"type": "chat", "id": mid, "messages": messages, "params": params})
    msgs = [ws.receive_json()]
    while msgs[-1]["type"] == "delta":
        msgs.append(ws.receive_json())
    return msgs


def test_the_first_message_carries_the_engine_request_id(client, fake):
    with client.websocket_connect("/v1/chat/ws") as ws:
        msgs = run_chat(ws, "a", {"max_tokens": 3})
    assert [m["type"] for m in msgs] == ["delta", "delta", "delta", "done"]
    rid = msgs[0]["request_id"]
    assert rid.startswith("chatcmpl-ws-") and all("request_id" not in m for m in msgs[1:])


def test_params_request_id_names_the_generation_as_on_http(client, fake):
    token = "Tok_en-0123456789abcdef"
    seen = []
    submit = fake.add_request

    def spy(request_id, *args, **kwargs):
        seen.append(request_id)
        return submit(request_id, *args, **kwargs)

    fake.add_request = spy
    try:
        with client.websocket_connect("/v1/chat/ws") as ws:
            msgs = run_chat(ws, "b", {"max_tokens": 2, "request_id": f"web-{token}-7"})
    finally:
        del fake.add_request
    assert msgs[0]["request_id"] == f"chatcmpl-web-{token}-7" and seen == [
        f"chatcmpl-web-{token}-7"
    ]
    # The KV view shows the row as the viewer's own to the page holding the token, anonymous to
    # others.
    row = {"request_id": msgs[0]["request_id"], "seqs": [{"seq_id": 3, "table": [1]}]}
    assert _Viewer(token)._row(row)["own"] is True
    assert _Viewer("someone-elses-token")._row(row)["request_id"].startswith("anon-")


def test_bad_params_leave_a_warning_in_the_log(client, caplog):
    with (
        caplog.at_level(logging.WARNING, logger=LOGGER),
        client.websocket_connect("/v1/chat/ws") as ws,
    ):
        msgs = run_chat(ws, "c", {"temperature": "hot"})
    assert msgs[0]["type"] == "error" and msgs[0]["error"]["param"] == "temperature"
    lines = [
        r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING
    ]
    assert len(lines) == 1 and "'c'" in lines[0] and "temperature" in lines[0] and "400" in lines[0]


def test_an_engine_error_leaves_a_warning_with_the_request_id(caplog):
    with make_client(FakeEngine()) as c, caplog.at_level(logging.WARNING, logger=LOGGER):
        wait_healthy(c)
        with c.websocket_connect("/v1/chat/ws") as ws:
            msgs = run_chat(
                ws,
                "d",
                {"max_tokens": 4, "request_id": "crash-1"},
                [{"role": "user", "content": chr(CRASH_TOKEN)}],
            )
    error = msgs[-1]
    assert error["type"] == "error" and error["error"]["type"] == "service_unavailable_error"
    assert msgs[0]["request_id"] == "chatcmpl-crash-1"  # the first message, whatever its type
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert any("'d'" in line and "chatcmpl-crash-1" in line and "503" in line for line in lines), (
        lines
    )
