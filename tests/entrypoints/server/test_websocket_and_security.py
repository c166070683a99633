"""End to end on a locked-down server: the WebSocket chat (with the ``websockets`` client),
API keys on HTTP and on the WebSocket handshake, Origin checks, 413 and 429."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from tests.entrypoints.conftest import run_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
ALLOWED = "http://allowed.example"
CHAT = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def server():
    with run_server(
        "--api-key",
        KEY,
        "--allowed-origins",
        ALLOWED,
        "--max-num-seqs",
        "2",
        "--max-queue-len",
        "2",
        "--max-request-body-bytes",
        "65536",
    ) as s:
        yield s


def ws_url(server) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/chat/ws"


def chat(mid, max_tokens: int, **params) -> str:
    return json.dumps(
        {
            "type": "chat",
            "id": mid,
            "messages": CHAT,
            "params": {"max_tokens": max_tokens, "temperature": 0, **params},
        }
    )


async def until_done(ws, mid) -> tuple[str, dict]:
    text = ""
    while True:
        msg = json.loads(await ws.recv())
        assert msg["id"] == mid and msg["type"] in ("delta", "done"), msg
        if msg["type"] == "done":
            return text, msg
        text += msg["text"]


def test_api_key_on_http(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        assert (
            c.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens
            == 2
        )
        with pytest.raises(openai.APIStatusError) as info:
            c.completions.create(model=MODEL, prompt="word " * 20_000, max_tokens=2)
        assert info.value.status_code == 413
    assert httpx.get(f"{server.url}/health").status_code == 200  # health and metrics stay open
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "Hi", "max_tokens": 2},
        headers={**AUTH, "Origin": "http://evil.example"},
    )
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"


def test_websocket_handshake_checks_key_and_origin(server):
    async def rejected(**kw) -> int:
        with pytest.raises(InvalidStatus) as info:
            async with connect(ws_url(server), **kw):
                pass
        return info.value.response.status_code

    async def main():
        assert await rejected() == 401
        assert await rejected(additional_headers={"Authorization": "Bearer nope"}) == 401
        assert await rejected(additional_headers=AUTH, origin="http://evil.example") == 403
        own = f"http://127.0.0.1:{server.port}"
        for kw in (
            dict(additional_headers=AUTH),
            dict(additional_headers=AUTH, origin=ALLOWED),
            dict(additional_headers=AUTH, origin=own),
            dict(subprotocols=["streamkv", f"bearer.{KEY}"], origin=own),
        ):
            async with connect(ws_url(server), **kw) as ws:
                await ws.send(chat("h", 2))
                _, done = await until_done(ws, "h")
                assert done["usage"]["completion_tokens"] == 2
                if "subprotocols" in kw:
                    assert ws.subprotocol == "streamkv"

    asyncio.run(main())


def test_websocket_chat_matches_http_and_runs_two_at_once(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        expected = c.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=6, temperature=0
        )

    async def main():
        async with connect(ws_url(server), additional_headers=AUTH) as ws:
            await ws.send(chat("one", 6))
            text, done = await until_done(ws, "one")
            assert text == expected.choices[0].message.content
            assert done["finish_reason"] == "length" and done["usage"] == expected.usage.model_dump(
                exclude_none=True
            )
            await ws.send(chat("a", 6))
            await ws.send(chat("b", 6))
            texts, order = {"a": "", "b": ""}, []
            while len([m for m in order if m[1] == "done"]) < 2:
                msg = json.loads(await ws.recv())
                order.append((msg["id"], msg["type"]))
                if msg["type"] == "delta":
                    texts[msg["id"]] += msg["text"]
            assert texts == {"a": text, "b": text}
            # Both ran concurrently: b produced text before a finished.
            assert order.index(("b", "delta")) < order.index(("a", "done"))

    asyncio.run(main())


def test_websocket_cancel_and_close_abort(server):
    async def main():
        async with connect(ws_url(server), additional_headers=AUTH) as ws:
            await ws.send(chat("long", 400, ignore_eos=True))
            assert json.loads(await ws.recv())["type"] == "delta"
            await ws.send(json.dumps({"type": "cancel", "id": "long"}))
            _, done = await until_done(ws, "long")
            assert done["finish_reason"] == "abort" and done["usage"]["completion_tokens"] < 400
        server.wait_idle(timeout=10)
        ws = await connect(ws_url(server), additional_headers=AUTH)
        await ws.send(chat("x", 400, ignore_eos=True))
        await ws.send(chat("y", 400, ignore_eos=True))
        assert json.loads(await ws.recv())["type"] == "delta"
        await ws.close()

    asyncio.run(main())
    server.wait_idle(timeout=10)


def test_queue_limit_gives_429_with_retry_after(server):
    """max_num_seqs=2 and max_queue_len=2: two running, two waiting, the fifth is refused."""

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as client:
            body = {
                "prompt": "Count slowly:",
                "max_tokens": 400,
                "ignore_eos": True,
                "stream": True,
            }
            ctxs = [client.stream("POST", "/v1/completions", json=body) for _ in range(4)]
            readers = []  # held: a line iterator that is garbage-collected closes its response
            for i, ctx in enumerate(ctxs):
                r = await ctx.__aenter__()
                assert r.status_code == 200
                if i < 2:  # wait until it runs, so that it no longer counts as waiting
                    readers.append(r.aiter_lines())
                    while not (await readers[-1].__anext__()).startswith("data: {"):
                        pass
            try:
                async with openai.AsyncOpenAI(
                    base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=30
                ) as c:
                    with pytest.raises(openai.RateLimitError) as info:
                        await c.completions.create(model=MODEL, prompt="One more", max_tokens=2)
                assert info.value.response.headers["retry-after"] == "1"
            finally:
                for ctx in ctxs:
                    await ctx.__aexit__(None, None, None)

    asyncio.run(main())
    server.wait_idle(timeout=15)
