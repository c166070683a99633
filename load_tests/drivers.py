"""Drivers for a running server: the OpenAI completions API over HTTP+SSE, and the chat
WebSocket. Loopback targets only."""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import json
from urllib.parse import urlsplit

from load_tests.runner import Clock, RequestRecord
from load_tests.workloads import BenchRequest


def loopback_only(url: str) -> str:
    host = urlsplit(url).hostname or ""
    try:
        ok = ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = host == "localhost"
    if not ok:
        raise SystemExit(f"refusing {url}: the benchmark only targets loopback addresses")
    return url.rstrip("/")


def sampling_fields(req: BenchRequest) -> dict:
    """Exactly ``output_len`` tokens per sample (ignore_eos), so every system does the same
    work and max_tokens is the true output length."""
    body = {"max_tokens": req.output_len, "ignore_eos": True}
    if req.beam_width:
        body.update(use_beam_search=True, n=req.beam_width, best_of=req.beam_width, temperature=0.0)
    else:
        body.update(n=req.n, temperature=1.0)
    return body


class RequestFailed(RuntimeError):
    pass


class OpenAIDriver:
    """POST /v1/completions with the prompt as token ids; streamed (SSE) except beam search,
    which the API only answers whole (no TTFT then)."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout: float = 600.0,
        max_connections: int = 1024,
    ) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(
            base_url=loopback_only(url),
            headers=headers,
            timeout=timeout,
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
        )

    async def send(self, req: BenchRequest, rec: RequestRecord, clock: Clock) -> None:
        body = {"prompt": req.prompt_ids, **sampling_fields(req)}
        if req.beam_width:
            r = await self.client.post("/v1/completions", json=body)
            if r.status_code != 200:
                raise RequestFailed(f"HTTP {r.status_code}: {r.text[:200]}")
            rec.output_tokens = r.json()["usage"]["completion_tokens"]
            rec.end = clock()
            return
        body.update(stream=True, stream_options={"include_usage": True})
        async with self.client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RequestFailed(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = clock()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RequestFailed(chunk["error"].get("message", "error event"))
                if chunk.get("choices") and any(c.get("text") for c in chunk["choices"]):
                    rec.chunk_times.append(now)
                if chunk.get("usage"):
                    rec.output_tokens = chunk["usage"]["completion_tokens"]
        rec.end = clock()

    async def close(self) -> None:
        await self.client.aclose()


class _Socket:
    def __init__(self, ws) -> None:
        self.ws, self.active = ws, 0
        self.inbox: dict[int, asyncio.Queue] = {}
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                msg = json.loads(raw)
                queue = self.inbox.get(msg.get("id"))
                if queue is not None:
                    queue.put_nowait(msg)
        finally:  # the socket closed: wake everyone still waiting on it
            for queue in self.inbox.values():
                queue.put_nowait({"type": "error", "error": {"message": "the WebSocket closed"}})


class WebSocketDriver:
    """Chats over /v1/chat/ws, several generations per socket (up to the server's
    ``--ws-max-active``), opening sockets as the load needs them. The socket speaks chat
    messages, so the prompt goes as the decoded text of its token ids (the chat template
    adds a few tokens); parallel sampling and beam search are not offered there."""

    def __init__(
        self, url: str, tokenizer, api_key: str | None = None, per_socket: int = 8
    ) -> None:
        base = loopback_only(url)
        self.url = "ws" + base[len("http") :] + "/v1/chat/ws"
        self.tokenizer, self.per_socket = tokenizer, per_socket
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.sockets: list[_Socket] = []
        self._ids = itertools.count()
        self._lock = asyncio.Lock()

    async def _acquire(self) -> _Socket:
        async with self._lock:
            sock = next((s for s in self.sockets if s.active < self.per_socket), None)
            if sock is None:
                from websockets.asyncio.client import connect

                sock = _Socket(
                    await connect(self.url, additional_headers=self.headers, max_size=None)
                )
                self.sockets.append(sock)
            sock.active += 1
            return sock

    async def send(self, req: BenchRequest, rec: RequestRecord, clock: Clock) -> None:
        if req.n > 1 or req.beam_width:
            raise ValueError("the WebSocket offers neither parallel sampling nor beam search")
        sock = await self._acquire()
        mid = next(self._ids)
        queue: asyncio.Queue = asyncio.Queue()
        sock.inbox[mid] = queue
        text = self.tokenizer.decode(req.prompt_ids)
        params = {k: v for k, v in sampling_fields(req).items() if k != "n"}
        try:
            await sock.ws.send(
                json.dumps(
                    {
                        "type": "chat",
                        "id": mid,
                        "params": params,
                        "messages": [{"role": "user", "content": text}],
                    }
                )
            )
            while True:
                msg = await queue.get()
                if msg["type"] == "delta":
                    rec.chunk_times.append(clock())
                elif msg["type"] == "done":
                    rec.output_tokens = msg["usage"]["completion_tokens"]
                    rec.end = clock()
                    return
                else:
                    raise RequestFailed(msg.get("error", {}).get("message", str(msg)[:200]))
        except asyncio.CancelledError:  # the time limit: the server stops generating too
            await asyncio.shield(sock.ws.send(json.dumps({"type": "cancel", "id": mid})))
            raise
        finally:
            del sock.inbox[mid]
            sock.active -= 1

    async def close(self) -> None:
        for sock in self.sockets:
            await sock.ws.close()
            sock.reader.cancel()
        await asyncio.gather(*(s.reader for s in self.sockets), return_exceptions=True)
