"""Issue 13 on a real server: the DNS-rebinding request refused (HTTP and WebSocket), idle and
slowloris sockets closed after their timeout, the connection cap, protocol errors in the
OpenAI shape, stop-string and min_tokens bounds, the queue limit exact under a burst, and
the per-client cap on failed authentications (last: it locks this client out)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from tests.entrypoints.conftest import run_server

pytestmark = pytest.mark.slow

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT = 1.0  # head, body and keep-alive timeouts of this server
CAP = 16


@pytest.fixture(scope="module")
def server():
    t = str(TIMEOUT)
    with run_server(
        "--api-key",
        KEY,
        "--max-num-seqs",
        "1",
        "--max-queue-len",
        "4",
        "--timeout-request-head",
        t,
        "--timeout-request-body",
        t,
        "--timeout-keep-alive",
        t,
        "--limit-concurrency",
        str(CAP),
    ) as s:
        yield s


def raw(server, data: bytes = b"", timeout: float = 10.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=timeout)
    if data:
        s.sendall(data)
    return s


def read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def error_of(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_rebinding_request_is_refused_on_http_and_websocket(server):
    body = {"prompt": "x", "max_tokens": 2}
    evil = {"Host": "evil.com", "Origin": "http://evil.com"}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers={**AUTH, **evil})
    assert r.status_code == 421 and r.json()["error"]["code"] == "host_not_allowed"
    # The Origin is compared with the allowed hosts, not with whatever Host says.
    r = httpx.post(
        f"{server.url}/v1/completions", json=body, headers={**AUTH, "Origin": "http://evil.com"}
    )
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    for host in ("localhost", f"127.0.0.1:{server.port}", f"localhost:{server.port}"):
        r = httpx.post(
            f"{server.url}/v1/completions", json=body, headers={**AUTH, "Host": host}, timeout=60
        )
        assert r.status_code == 200, (host, r.text)
    own = {"Origin": f"http://localhost:{server.port}", "Host": f"localhost:{server.port}"}
    assert (
        httpx.post(
            f"{server.url}/v1/completions", json=body, headers={**AUTH, **own}, timeout=60
        ).status_code
        == 200
    )

    handshake = (
        b"GET /v1/chat/ws HTTP/1.1\r\nHost: evil.com\r\nOrigin: http://evil.com\r\n"
        b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nAuthorization: Bearer "
        + KEY.encode()
        + b"\r\n\r\n"
    )
    with raw(server, handshake) as s:
        status, err = error_of(read_all(s))
    assert status == 421 and err["code"] == "host_not_allowed"
    assert "ERROR" not in server.log()  # refusals are logged at INFO (not shown at this level)


def test_idle_and_slowloris_sockets_are_closed_after_the_timeout(server):
    def closed_after(s: socket.socket, drip: bytes = b"") -> tuple[float, bytes]:
        start, out = time.monotonic(), b""
        s.settimeout(0.2)
        while time.monotonic() - start < 10:
            if drip:  # one byte at a time, forever: the deadline must not move
                try:
                    s.send(drip[:1])
                except OSError:
                    break
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:  # closed with our drip unread: the kernel resets
                break
            if not chunk:
                break
            out += chunk
        return time.monotonic() - start, out

    with raw(server) as s:  # sends nothing
        took, out = closed_after(s)
    assert TIMEOUT * 0.8 < took < TIMEOUT + 2 and error_of(out)[1]["code"] == "request_timeout"
    with raw(server, b"GET /health HTTP/1.1\r\n") as s:  # a head that never ends
        took, out = closed_after(s, b"X")
    assert took < TIMEOUT + 2 and (not out or error_of(out)[0] == 408)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n"
        b"Authorization: Bearer " + KEY.encode() + b"\r\n\r\n"
    )
    with raw(server, head + b"{") as s:  # a body that never ends
        took, out = closed_after(s, b" ")
    assert took < TIMEOUT + 2 and (not out or error_of(out)[1]["code"] == "request_timeout")
    with raw(
        server, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    ) as s:  # idle after a response
        took, out = closed_after(s)
    assert out.startswith(b"HTTP/1.1 200") and took < TIMEOUT + 2
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_connection_cap_answers_json_503(server):
    held = [raw(server) for _ in range(CAP)]
    try:
        time.sleep(0.1)
        with raw(server, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n") as s:
            status, err = error_of(read_all(s))
        assert status == 503 and err["code"] == "too_many_connections"
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_protocol_errors_are_openai_json(server):
    for request in (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n{}",
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
        b"Authorization: Bearer " + KEY.encode() + b"\r\n\r\nzz\r\n",
        b"NOT HTTP AT ALL\r\n\r\n",
        b"GET /health HTTP/1.1\r\n\r\n",  # HTTP/1.1 without Host
    ):
        with raw(server, request) as s:
            status, err = error_of(read_all(s))
        assert status == 400 and err["code"] == "invalid_http_request", request
    # A head over --max-header-bytes (16 KiB) gets a 431, whether it arrives whole or as one
    # header line that never ends (h11 bounds what it holds of an incomplete head).
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "
    for data, pause in ((head + b"a" * 20000 + b"\r\n\r\n", 0.0), (head + b"a" * 4096, 0.05)):
        with raw(server) as s:
            try:
                for _ in range(1 if pause == 0 else 4):  # refused once the 4th 4 KiB is in
                    s.sendall(data)
                    time.sleep(pause)
                    data = b"a" * 4096
            except OSError:  # closed while we were still sending
                pass
            status, err = error_of(read_all(s))
        # Whole: the Guard middleware's answer; in pieces: h11's, before any application.
        assert status == 431 and err["code"] in ("headers_too_large", "invalid_http_request")
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_stop_strings_and_min_tokens_are_bounded(server):
    def post(body: dict) -> httpx.Response:
        return httpx.post(
            f"{server.url}/v1/chat/completions",
            headers=AUTH,
            timeout=60,
            json={"messages": [{"role": "user", "content": "hi"}], **body},
        )

    for stop in (["s"] * 33, ["x" * 1025]):
        r = post({"stop": stop, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    assert post({"stop": ["x" * 1024] * 32, "max_tokens": 2}).status_code == 200
    # EOS banned for a billion tokens with no max_tokens: the request could only end at the
    # context's edge. Refused like an oversized max_tokens.
    r = post({"min_tokens": 10**9})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert post({"min_tokens": 3, "max_tokens": 3}).json()["usage"]["completion_tokens"] == 3


def test_queue_limit_is_exact_under_a_simultaneous_burst(server):
    """max_num_seqs=1 is busy; --max-queue-len 4: of 10 simultaneous requests, exactly 4 wait."""

    async def main():
        body = {"prompt": "Count slowly:", "max_tokens": 400, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as client:
            async with client.stream("POST", "/v1/completions", json=body) as busy:
                lines = busy.aiter_lines()
                while not (await lines.__anext__()).startswith("data: {"):
                    pass

                async def one() -> int:
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        return r.status_code  # leaving closes it: the waiting ones are aborted

                gate = asyncio.Event()

                async def burst_one() -> int:
                    await gate.wait()
                    return await one()

                tasks = [asyncio.create_task(burst_one()) for _ in range(10)]
                await asyncio.sleep(0.05)
                gate.set()
                statuses = await asyncio.gather(*tasks)
        return statuses

    statuses = asyncio.run(main())
    assert sorted(statuses) == [200] * 4 + [429] * 6
    server.wait_idle(timeout=30)


def test_websocket_subprotocols_and_failed_auths_are_capped(server):
    """Last in this module: it locks this client's address out of the server."""

    def handshake(protocols: list[str], key: str | None = None) -> tuple[int, dict]:
        head = (
            b"GET /v1/chat/ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: "
            b"websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        )
        if protocols:
            head += b"Sec-WebSocket-Protocol: " + ", ".join(protocols).encode() + b"\r\n"
        if key:
            head += b"Authorization: Bearer " + key.encode() + b"\r\n"
        with raw(server, head + b"\r\n") as s:
            return error_of(read_all(s))

    status, err = handshake(["streamkv"] + [f"bearer.guess{i}" for i in range(200)])
    assert status == 400 and err["code"] == "too_many_subprotocols"
    codes = [
        handshake(["streamkv", "bearer.a", "bearer.b", f"bearer.{KEY}"])[1]["code"]
    ]  # third not tried
    codes += [
        httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer nope"}).json()[
            "error"
        ]["code"]
        for _ in range(12)
    ]
    assert codes[:10] == ["invalid_api_key"] * 10
    assert codes[10:] == ["too_many_auth_failures"] * 3
    r = httpx.get(f"{server.url}/v1/models", headers=AUTH)  # the right key waits too
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert "ERROR" not in server.log()
