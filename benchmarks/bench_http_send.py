"""The event loop's CPU per SSE event under uvicorn's two HTTP/1.1 protocols (h11, pure
Python; httptools, C), with the server's own SSE response: why entrypoints/server/
connections.py builds on httptools. One server process per protocol and round, on loopback;
a raw-socket client reads N streams of E events each and asks the server for its CPU time.

    python benchmarks/bench_http_send.py --streams 200 --events 300 --rounds 3

Prints a table (server CPU seconds and microseconds per event) and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time

CHUNK = {
    "id": "cmpl-0123456789abcdef",
    "object": "text_completion",
    "created": 1700000000,
    "model": "llama3-8b",
    "choices": [{"index": 0, "text": " word", "logprobs": None, "finish_reason": None}],
}


def serve(protocol: str, port: int, events: int) -> None:
    """The server: one streaming route and one that reports this process's CPU time."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from streamkv.entrypoints.openai.streaming import DONE, SSEResponse, sse_event

    async def stream(request):
        async def body():
            for _ in range(events):
                yield sse_event(CHUNK)
                await asyncio.sleep(0)  # one send per loop turn, as engine steps arrive
            yield DONE

        return SSEResponse(body())

    async def cpu(request):
        r = resource.getrusage(resource.RUSAGE_SELF)
        return PlainTextResponse(str(r.ru_utime + r.ru_stime))

    app = Starlette(routes=[Route("/s", stream), Route("/cpu", cpu)])
    uvicorn.run(app, host="127.0.0.1", port=port, http=protocol, log_level="warning")


async def _get(port: int, path: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    out = b""
    while not out.endswith(b"0\r\n\r\n"):  # the chunked body's end
        data = await reader.read(65536)
        if not data:
            break
        out += data
    writer.close()
    return out


async def _server_cpu(port: int) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /cpu HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    data = await reader.read()
    writer.close()
    return float(data.split(b"\r\n\r\n", 1)[1])


async def load(port: int, streams: int) -> tuple[float, float]:
    before = await _server_cpu(port)
    start = time.perf_counter()
    await asyncio.gather(*(_get(port, "/s") for _ in range(streams)))
    seconds = time.perf_counter() - start
    return await _server_cpu(port) - before, seconds


def one_round(protocol: str, streams: int, events: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, __file__, "--serve", protocol, "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--events", str(events)], env={**os.environ})
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.05)
        cpu, seconds = asyncio.run(load(port, streams))
    finally:
        proc.terminate()
        proc.wait(10)
    return {"protocol": protocol, "server_cpu_s": cpu, "wall_s": seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--events", type=int, default=300, help="SSE events per stream")
    ap.add_argument("--rounds", type=int, default=3, help="alternating h11 / httptools rounds")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.events)
        return 0
    rows = [
        one_round(p, args.streams, args.events)
        for _ in range(args.rounds)
        for p in ("h11", "httptools")
    ]
    n = args.streams * args.events
    print(f"{args.streams} streams x {args.events} events, {args.rounds} rounds (median)")
    print(f"{'protocol':<10}{'server CPU s':>14}{'us / event':>12}{'wall s':>9}")
    summary = {}
    for p in ("h11", "httptools"):
        cpu = statistics.median(r["server_cpu_s"] for r in rows if r["protocol"] == p)
        wall = statistics.median(r["wall_s"] for r in rows if r["protocol"] == p)
        summary[p] = {"server_cpu_s": cpu, "us_per_event": cpu / n * 1e6, "wall_s": wall}
        print(f"{p:<10}{cpu:>14.2f}{cpu / n * 1e6:>12.1f}{wall:>9.2f}")
    ratio = summary["httptools"]["server_cpu_s"] / summary["h11"]["server_cpu_s"]
    print(f"httptools / h11 server CPU: {ratio:.2f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "rounds": rows, "median": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
