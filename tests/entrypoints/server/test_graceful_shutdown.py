"""SIGTERM with requests in flight (issue 13): new connections are refused at once, a request
that can finish within --shutdown-timeout finishes normally, and the rest end with an
OpenAI-shaped error: an error event then [DONE] (SSE), a 503 JSON (non-streaming), an error
message then close code 1012 (WebSocket). The process ends cleanly, with no traceback."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.entrypoints.conftest import run_server

pytestmark = pytest.mark.slow

DRAIN = 6.0
LONG = {"prompt": "Count slowly:", "max_tokens": 900, "ignore_eos": True}


async def sse_events(client: httpx.AsyncClient, body: dict, first: asyncio.Event) -> list[str]:
    events = []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                first.set()
    return events


async def ws_messages(port: int, first: asyncio.Event) -> tuple[list[dict], int | None]:
    msgs = []
    async with connect(f"ws://127.0.0.1:{port}/v1/chat/ws") as ws:
        await ws.send(
            json.dumps(
                {
                    "type": "chat",
                    "id": 1,
                    "messages": [{"role": "user", "content": "Count:"}],
                    "params": {"max_tokens": 900, "ignore_eos": True},
                }
            )
        )
        try:
            while True:
                msgs.append(json.loads(await ws.recv()))
                first.set()
        except ConnectionClosed as e:
            return msgs, e.rcvd.code if e.rcvd else None


def test_sigterm_drains_then_ends_the_rest_with_openai_errors():
    with run_server("--shutdown-timeout", str(DRAIN), "--max-num-seqs", "8") as server:

        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                started = [asyncio.Event() for _ in range(3)]
                long_sse = asyncio.create_task(sse_events(client, LONG, started[0]))
                ws = asyncio.create_task(ws_messages(server.port, started[1]))
                plain = asyncio.create_task(client.post("/v1/completions", json=LONG))
                short = asyncio.create_task(
                    sse_events(client, {"prompt": "Hi", "max_tokens": 2}, started[2])
                )
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
                await asyncio.sleep(0.3)  # the non-streaming request is in the engine by now
                server.proc.send_signal(signal.SIGTERM)
                t0 = time.monotonic()
                await asyncio.sleep(0.5)
                with pytest.raises(ConnectionRefusedError):
                    socket.create_connection(("127.0.0.1", server.port), timeout=2).close()
                results = await asyncio.wait_for(
                    asyncio.gather(long_sse, ws, plain, short), DRAIN + 30
                )
                return results, time.monotonic() - t0

        (long_events, (msgs, close_code), plain, short_events), took = asyncio.run(main())
        # uvicorn re-raises the signal once shut down, so a supervisor sees "terminated".
        assert server.proc.wait(30) in (0, -signal.SIGTERM)
        assert "shutdown: ending 3 request(s) still running" in server.log(), short_events

        error = json.loads(long_events[-2])["error"]
        assert long_events[-1] == "[DONE]" and error["code"] == "server_shutting_down", long_events[
            -3:
        ]
        assert all("error" not in json.loads(e) for e in long_events[:-2])
        assert took >= DRAIN - 0.5  # it was given its time, not cut at the signal
        assert (
            short_events[-1] == "[DONE]"
            and json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"
        )
        assert plain.status_code == 503 and plain.json()["error"]["code"] == "server_shutting_down"
        assert msgs[-1]["type"] == "error" and msgs[-1]["error"]["code"] == "server_shutting_down"
        assert close_code == 1012
