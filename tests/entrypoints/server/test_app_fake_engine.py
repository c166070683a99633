"""The HTTP/WebSocket app on a fake engine (no model): response shapes, keep-alive, health,
engine death, auth and origin checks, and a fuzz run proving bad input never gets a 500."""

from __future__ import annotations

import gc
import json
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamkv.heap import YOUNG_THRESHOLD
from tests.entrypoints.fake_engine import (
    CRASH_TOKEN,
    FakeEngine,
    make_client,
    sse_events,
    wait_healthy,
)


@pytest.fixture(scope="module")
def client():
    with make_client(sse_keepalive=0.05) as c:
        wait_healthy(c)
        yield c


def test_health_is_503_while_loading_then_200():
    gate = threading.Event()

    def build():
        gate.wait(10)
        return FakeEngine()

    with make_client(build=build) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
        assert c.post("/v1/completions", json={"prompt": "hi"}).status_code == 503
        gate.set()
        wait_healthy(c)


def test_a_ready_server_keeps_the_cyclic_gc_off_its_heap():
    # streamkv/heap.py: once ready, the start-up heap is frozen and young collections rarer.
    with make_client() as c:
        wait_healthy(c)
        deadline = time.monotonic() + 10
        while gc.get_threshold()[0] != YOUNG_THRESHOLD and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gc.get_threshold()[0] == YOUNG_THRESHOLD
        assert gc.get_freeze_count() > 0


def test_engine_death_gives_503_not_500_and_asks_the_server_to_exit():
    exits = threading.Event()
    with make_client(FakeEngine(step_delay=0.01), on_load_failure=exits.set) as c:
        wait_healthy(c)
        streamed: list = []
        reader = threading.Thread(
            target=lambda: streamed.append(
                c.post(
                    "/v1/completions", json={"prompt": "abc", "max_tokens": 10_000, "stream": True}
                )
            )
        )
        reader.start()
        time.sleep(0.3)
        r = c.post("/v1/completions", json={"prompt": [CRASH_TOKEN], "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        reader.join(10)
        events, _ = sse_events(streamed[0].text)  # the same code on the streaming path
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_dead"
        health = c.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and "Traceback" not in r.text
        # A dead engine serves nothing: the server is told to exit (cmd_serve then returns 1).
        assert exits.wait(5)


def test_streaming_n2_indices_finish_once_and_usage(client):
    body = {
        "prompt": "abc",
        "max_tokens": 5,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events, _ = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 10,
        "total_tokens": 13,
    }
    finishes = {0: 0, 1: 0}
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        assert c["usage"] is None and len(c["choices"]) == 1
        ch = c["choices"][0]
        texts[ch["index"]] += ch["text"]
        finishes[ch["index"]] += ch["finish_reason"] is not None
    assert finishes == {0: 1, 1: 1} and all(len(t) == 5 for t in texts.values())


def test_chat_stream_first_delta_has_role_and_logprobs(client):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 1,
    }
    events, _ = sse_events(client.post("/v1/chat/completions", json=body).text)
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c["choices"][0]["logprobs"]["content"] for c in chunks[1:]]
    assert sum(len(c) for c in content) == 3
    assert all(len(e["top_logprobs"]) == 1 and e["bytes"] for c in content for e in c)
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1


def test_echo_multiple_prompts_continuous_usage_and_tokenize(client):
    r = client.post(
        "/v1/completions", json={"prompt": ["ab", [120, 121]], "max_tokens": 2, "echo": True}
    ).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert r["choices"][0]["text"].startswith("ab") and r["choices"][1]["text"].startswith("xy")
    assert r["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    body = {
        "prompt": "abc",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    events, _ = sse_events(client.post("/v1/completions", json=body).text)
    usages = [json.loads(e)["usage"]["completion_tokens"] for e in events[:-1]]
    assert usages == sorted(usages) and usages[-1] == 3
    t = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert t["count"] == len(t["tokens"]) == len("<user>hi<assistant>")
    assert client.post("/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}


def test_sse_keepalive_comments_while_waiting():
    with make_client(FakeEngine(step_delay=0.05), sse_keepalive=0.05) as c:
        wait_healthy(c)
        r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 8, "stream": True})
        events, comments = sse_events(r.text)
        assert events[-1] == "[DONE]" and comments


def test_unknown_route_and_method_use_openai_error_shape(client):
    r = client.get("/v1/nope")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert client.get("/v1/completions").status_code == 405


def test_demo_page_and_assets(client):
    r = client.get("/")
    assert r.status_code == 200 and "/v1/chat/ws" not in r.text and "app.js" in r.text
    assert "default-src 'self'" in r.headers["content-security-policy"]
    assert client.get("/web/app.js").status_code == 200
    js = client.get("/web/transport.js")  # the WebSocket client lives here
    assert js.status_code == 200 and "/v1/chat/ws" in js.text
    assert client.get("/web/style.css").status_code == 200


def test_oversized_headers_get_431(client):
    r = client.get("/v1/models", headers={"x-filler": "y" * 20_000})
    assert r.status_code == 431 and r.json()["error"]["code"] == "headers_too_large"


def test_api_key_and_origin():
    with make_client(api_key="s3cret", allowed_origins=("http://ok.example",)) as c:
        wait_healthy(c)
        body = {"prompt": "a", "max_tokens": 1}
        assert c.post("/v1/completions", json=body).status_code == 401
        assert (
            c.post(
                "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}
            ).status_code
            == 401
        )
        auth = {"Authorization": "Bearer s3cret"}
        assert c.post("/v1/completions", json=body, headers=auth).status_code == 200
        evil = {**auth, "Origin": "http://evil.example"}
        assert c.post("/v1/completions", json=body, headers=evil).status_code == 403
        ok = {**auth, "Origin": "http://ok.example"}
        r = c.post("/v1/completions", json=body, headers=ok)
        assert (
            r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ok.example"
        )
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200


def test_websocket_protocol_errors_keep_socket_open(client):
    with client.websocket_connect("/v1/chat/ws") as ws:
        ws.send_text("{not json")
        assert ws.receive_json()["type"] == "error"
        ws.send_json({"type": "dance", "id": "x"})
        assert ws.receive_json()["error"]["param"] == "type"
        ws.send_json({"type": "cancel", "id": "nothing"})
        assert ws.receive_json()["error"]["code"] == "unknown_id"
        ws.send_json({"type": "chat", "id": "p", "messages": [], "params": {}})
        assert ws.receive_json() == {
            "type": "error",
            "id": "p",
            "error": {
                "message": "'messages' must not be empty",
                "type": "invalid_request_error",
                "param": "messages",
                "code": None,
            },
        }
        ws.send_json(
            {
                "type": "chat",
                "id": 7,
                "messages": [{"role": "user", "content": "x"}],
                "params": {"max_tokens": 2},
            }
        )
        msgs = [ws.receive_json() for _ in range(3)]
        assert [m["type"] for m in msgs] == ["delta", "delta", "done"] and msgs[-1]["id"] == 7


_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 10**6),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=5),
    st.lists(st.integers(-2, 2000), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
_fields = [
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "best_of",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "stream",
    "stream_options",
    "top_k",
    "min_p",
    "presence_penalty",
    "stop_token_ids",
    "use_beam_search",
    "min_tokens",
    "echo",
    "model",
    "logit_bias",
    "repetition_penalty",
]


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]),
    st.dictionaries(st.sampled_from(_fields), _values, max_size=6),
    st.booleans(),
)
def test_fuzzed_bodies_never_get_a_500(client, path, body, valid_prompt):
    if valid_prompt:
        body.setdefault("prompt", "hello")
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
        body["max_tokens"] = 2
    r = client.post(path, json=body)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    "raw",
    [
        b"{",
        b"\xff\xfe",
        b"[1, 2]",
        b'{"prompt": "\\ud800"}',
        b'{"prompt": NaN}',
        b"[" * 100_000,
        b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}",
    ],
)
def test_malformed_bodies_get_400(client, raw):
    r = client.post("/v1/completions", content=raw)
    assert r.status_code == 400, r.text


def test_a_stream_ends_without_a_worker_thread_hop(client, monkeypatch):
    # The SSE response's background abort is a coroutine: a plain function would go through
    # anyio's thread pool once per streamed request (a burst's cost, docs/benchmarks.md).
    import anyio.to_thread

    hops = []
    real = anyio.to_thread.run_sync

    async def counting(func, *args, **kw):
        hops.append(func)
        return await real(func, *args, **kw)

    monkeypatch.setattr(anyio.to_thread, "run_sync", counting)
    for path, body in (
        ("/v1/completions", {"prompt": "abc", "max_tokens": 3, "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True}),
    ):
        r = client.post(path, json={**body, "max_tokens": 3})
        assert r.status_code == 200 and sse_events(r.text)[0][-1] == "[DONE]"
    assert hops == []
