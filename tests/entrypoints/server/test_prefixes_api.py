"""The reserved-prefix admin API (entrypoints/server/prefixes.py) on a real engine (the embedded
model, CPU): register by text and by ids, completions that start with a prefix map its
blocks, /metrics shows the pinned blocks, delete frees them, bad input gets OpenAI-shaped
400s / 404s."""

from __future__ import annotations

import time

import pytest
from starlette.testclient import TestClient

from streamkv.engine.async_engine import AsyncEngine
from streamkv.entrypoints.llm import build_engine, engine_config
from streamkv.entrypoints.server.app import ServerConfig, build_app
from streamkv.entrypoints.server.security import HostPolicy

pytestmark = (
    pytest.mark.slow
)  # the embedded model behind a real app: tens of seconds on a loaded CPU

SYSTEM = (
    "You are a helpful assistant who answers in one short sentence, politely and plainly.\n" * 2
)


@pytest.fixture(scope="module")
def client():
    config = engine_config(
        None, device="cpu", block_size=16, num_kv_blocks=96, num_swap_blocks=0, max_model_len=512
    )
    engine = AsyncEngine(lambda: build_engine(config))
    app = build_app(
        engine, ServerConfig(model_name="m", hosts=HostPolicy.build("testserver"), web_dir=None)
    )
    with TestClient(app) as c:
        for _ in range(1200):
            if c.get("/health").status_code == 200:
                break
            time.sleep(0.05)
        assert c.get("/health").status_code == 200, "the engine did not start"
        yield c, engine


def _gauge(c: TestClient, name: str) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(f"streamkv:{name}{{") or line.startswith(f"streamkv:{name} "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in /metrics")


def _wait_stats(engine: AsyncEngine, key: str, want: int) -> None:
    for _ in range(100):
        if engine.stats.get(key) == want:
            return
        time.sleep(0.05)
    raise AssertionError(f"{key} = {engine.stats.get(key)}, expected {want}")


def test_register_use_list_and_delete(client):
    c, engine = client
    r = c.post("/v1/prefixes", json={"prompt": SYSTEM})
    assert r.status_code == 200, r.text
    prefix = r.json()
    assert prefix["object"] == "reserved_prefix" and prefix["status"] == "ready"
    assert prefix["num_blocks"] == prefix["num_tokens"] // 16 > 0
    _wait_stats(engine, "num_pinned_kv_blocks", prefix["num_blocks"])
    assert _gauge(c, "pinned_kv_blocks") == prefix["num_blocks"]
    # The same text again is the same prefix.
    assert c.post("/v1/prefixes", json={"prompt": SYSTEM}).json()["id"] == prefix["id"]
    before = engine.stats["num_prompt_tokens"]
    r = c.post(
        "/v1/completions",
        json={"model": "m", "prompt": SYSTEM + "What is two plus two?", "max_tokens": 2},
    )
    assert r.status_code == 200, r.text
    listed = c.get("/v1/prefixes").json()
    assert listed["object"] == "list" and [p["id"] for p in listed["data"]] == [prefix["id"]]
    assert listed["data"][0]["num_uses"] == 1
    used = r.json()["usage"]["prompt_tokens"]
    for _ in range(100):  # stats are refreshed by the engine thread
        if engine.stats["num_prompt_tokens"] > before:
            break
        time.sleep(0.05)
    assert engine.stats["num_prompt_tokens"] - before == used - prefix["num_shared_tokens"]
    r = c.delete(f"/v1/prefixes/{prefix['id']}")
    assert r.status_code == 200 and r.json()["deleted"] is True
    _wait_stats(engine, "num_pinned_kv_blocks", 0)
    _wait_stats(engine, "num_free_kv_blocks", 96)  # no block leaked
    assert c.get("/v1/prefixes").json()["data"] == []


def test_register_by_token_ids(client):
    c, engine = client
    ids = [(13 * i) % 5000 + 10 for i in range(40)]
    r = c.post("/v1/prefixes", json={"prompt": ids, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["num_tokens"], body["num_blocks"], body["num_shared_tokens"]) == (40, 2, 32)
    assert c.delete(f"/v1/prefixes/{body['id']}").status_code == 200


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": "short"}, "prompt"),  # under one whole block
        ({"prompt": [10**9] * 20}, "prompt"),  # outside the vocabulary
        ({"prompt": "x", "add_special_tokens": 1}, "add_special_tokens"),
        ({"prompt": "x", "temperature": 0}, "temperature"),
    ],
)
def test_bad_input_is_an_openai_400(client, body, param):
    c, _ = client
    r = c.post("/v1/prefixes", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_unknown_id_is_a_404_and_the_server_keeps_serving(client):
    c, _ = client
    r = c.delete("/v1/prefixes/pfx-404")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "prefix_not_found"
    assert (
        c.post(
            "/v1/prefixes", content=b"{not json", headers={"content-type": "application/json"}
        ).status_code
        == 400
    )
    assert c.get("/health").status_code == 200
