"""A bounded load generator for a streamkv server on this machine (loopback addresses only).

Sends a weighted mix of streaming and whole completions and chats, WebSocket chats, streams
the client drops after the first token, and malformed requests, from ``--concurrency``
workers; it stops after ``--requests`` requests or ``--duration`` seconds, whichever comes
first (both are capped). Then it checks that the server went idle with every KV block free
and that no request got a 5xx. Prints a report, writes JSON, exits 1 on a failed check.
A robustness soak (closed loop); the open-loop serving benchmark is ``load_tests/bench.py``.

    python load_tests/loadgen.py --start-server --requests 300 --concurrency 24 --duration 180
    python load_tests/loadgen.py --url http://127.0.0.1:8000 --requests 100
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import random
import re
import sys
import time
from collections import defaultdict
from urllib.parse import urlsplit

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MAX_REQUESTS, MAX_CONCURRENCY, MAX_DURATION, MAX_TOKENS = 5000, 256, 900.0, 512
KINDS = {
    "completion_stream": 3,
    "completion": 2,
    "chat_stream": 3,
    "websocket": 2,
    "dropped_stream": 2,
    "bad": 1,
}
WORDS = "the a cat dog river mountain story light code engine block token cache sea sky".split()
BAD_BODIES = [
    b"{",
    b"\xff\xfe",
    b'{"prompt": ""}',
    b'{"prompt": "x", "temperature": -1}',
    b'{"prompt": "x", "n": 10000}',
    b'{"messages": []}',
    b'{"prompt": "x", "frobnicate": 1}',
    b"[1, 2]",
    b'{"prompt": [99999999]}',
]


def loopback_only(url: str) -> str:
    host = urlsplit(url).hostname or ""
    try:
        ok = ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = host == "localhost"
    if not ok:
        raise SystemExit(f"refusing {url}: this load generator only targets loopback addresses")
    return url.rstrip("/")


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))


class Report:
    def __init__(self) -> None:
        self.rows: dict[str, dict] = defaultdict(
            lambda: {
                "n": 0,
                "ok": 0,
                "status": defaultdict(int),
                "latency": [],
                "ttft": [],
                "tokens": 0,
            }
        )

    def add(
        self,
        kind: str,
        status: int | str,
        latency: float,
        ttft: float | None = None,
        tokens: int = 0,
        ok: bool = True,
    ) -> None:
        r = self.rows[kind]
        r["n"] += 1
        r["ok"] += ok
        r["status"][str(status)] += 1
        r["latency"].append(latency)
        if ttft is not None:
            r["ttft"].append(ttft)
        r["tokens"] += tokens

    def summary(self) -> dict:
        def pct(v: list[float], q: float) -> float:
            return sorted(v)[min(len(v) - 1, int(q * len(v)))] * 1e3 if v else 0.0

        return {
            k: {
                "n": r["n"],
                "ok": r["ok"],
                "status": dict(r["status"]),
                "tokens": r["tokens"],
                "latency_ms": {"p50": pct(r["latency"], 0.5), "p99": pct(r["latency"], 0.99)},
                "ttft_ms": {"p50": pct(r["ttft"], 0.5), "p99": pct(r["ttft"], 0.99)},
            }
            for k, r in sorted(self.rows.items())
        }


async def one(
    kind: str, client, url: str, headers: dict, rng: random.Random, max_tokens: int, report: Report
) -> None:
    t0 = time.perf_counter()
    mt = rng.randint(1, max_tokens)
    if kind == "bad":
        r = await client.post("/v1/completions", content=rng.choice(BAD_BODIES), headers=headers)
        return report.add(
            kind, r.status_code, time.perf_counter() - t0, ok=400 <= r.status_code < 500
        )
    if kind == "websocket":
        from websockets.asyncio.client import connect

        ws_url = url.replace("http", "ws", 1) + "/v1/chat/ws"
        async with connect(ws_url, additional_headers=headers) as ws:
            await ws.send(
                json.dumps(
                    {
                        "type": "chat",
                        "id": 1,
                        "messages": [{"role": "user", "content": prompt(rng)}],
                        "params": {"max_tokens": mt, "temperature": 0.8},
                    }
                )
            )
            ttft = None
            while True:
                msg = json.loads(await ws.recv())
                if msg["type"] == "delta" and ttft is None:
                    ttft = time.perf_counter() - t0
                if msg["type"] in ("done", "error"):
                    ok = msg["type"] == "done"
                    tokens = msg["usage"]["completion_tokens"] if ok else 0
                    return report.add(kind, msg["type"], time.perf_counter() - t0, ttft, tokens, ok)
    chat = kind == "chat_stream"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"max_tokens": mt, "temperature": 0.8, "stream": kind != "completion"}
    body.update(
        {"messages": [{"role": "user", "content": prompt(rng)}]}
        if chat
        else {"prompt": prompt(rng)}
    )
    if kind == "completion":
        r = await client.post(path, json=body, headers=headers)
        tokens = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0
        return report.add(
            kind, r.status_code, time.perf_counter() - t0, None, tokens, r.status_code == 200
        )
    body["stream_options"] = {"include_usage": True}
    ttft, tokens = None, 0
    async with client.stream("POST", path, json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return report.add(kind, r.status_code, time.perf_counter() - t0, ok=False)
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk["choices"]:
                ttft = time.perf_counter() - t0
                if kind == "dropped_stream":
                    break  # leave mid-stream: the server must abort and free the blocks
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    report.add(kind, 200, time.perf_counter() - t0, ttft, tokens)


async def run(args, url: str) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    kinds = [k for k, w in KINDS.items() for _ in range(w)]
    report, deadline = Report(), time.monotonic() + args.duration
    todo = iter(range(args.requests))
    failures: list[str] = []

    async def worker(client, wid: int) -> None:
        wrng = random.Random(args.seed * 1000 + wid)
        for _ in todo:
            if time.monotonic() > deadline:
                return
            kind = wrng.choice(kinds)
            try:
                await one(kind, client, url, headers, wrng, args.max_tokens, report)
            except Exception as e:  # a transport failure is a finding, not a crash of the tool
                failures.append(f"{kind}: {type(e).__name__}: {e}")
                report.add(kind, type(e).__name__, 0.0, ok=False)

    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(
        base_url=url, timeout=args.request_timeout, limits=limits
    ) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client, i) for i in range(args.concurrency)))
        elapsed = time.perf_counter() - t0
    return {"elapsed_s": elapsed, "kinds": report.summary(), "transport_failures": failures[:20]}


def wait_idle(url: str, timeout: float = 30.0) -> dict:
    import httpx

    deadline, m = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        m = {g: float(v) for g, v in re.findall(r"^vllm:(\w+)\{[^}]*\} (\S+)$", text, re.M)}
        if all(
            m.get(k, 1) == 0
            for k in (
                "num_requests_running",
                "num_requests_waiting",
                "num_requests_swapped",
                "kv_cache_usage_perc",
            )
        ):
            return {
                "idle": True,
                **{k: m[k] for k in ("kv_cache_usage_perc", "num_requests_running")},
            }
        time.sleep(0.2)
    return {
        "idle": False,
        **{
            k: m.get(k)
            for k in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting")
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="a loopback URL")
    ap.add_argument(
        "--start-server", action="store_true", help="start `streamkv serve` on a free loopback port"
    )
    ap.add_argument(
        "--server-args",
        default="--num-kv-blocks 512 --num-swap-blocks 64",
        help="extra flags for --start-server",
    )
    ap.add_argument("--api-key", default=os.environ.get("STREAMKV_API_KEY"))
    ap.add_argument("--requests", type=int, default=200, help=f"total requests (<= {MAX_REQUESTS})")
    ap.add_argument("--concurrency", type=int, default=16, help=f"workers (<= {MAX_CONCURRENCY})")
    ap.add_argument(
        "--duration", type=float, default=120.0, help=f"seconds (<= {MAX_DURATION:.0f})"
    )
    ap.add_argument(
        "--max-tokens", type=int, default=48, help=f"per request, drawn from 1..N (<= {MAX_TOKENS})"
    )
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default="bench_results/loadgen.json")
    args = ap.parse_args()
    args.requests = max(1, min(args.requests, MAX_REQUESTS))
    args.concurrency = max(1, min(args.concurrency, MAX_CONCURRENCY))
    args.duration = max(1.0, min(args.duration, MAX_DURATION))
    args.max_tokens = max(1, min(args.max_tokens, MAX_TOKENS))

    server = None
    if args.start_server:
        from contextlib import ExitStack

        from load_tests.local_server import local_server

        stack = ExitStack()
        extra = args.server_args.split() + (["--api-key", args.api_key] if args.api_key else [])
        server = stack.enter_context(
            local_server(["--device", "cpu", "--max-model-len", "1024", *extra])
        )
        url = server.url
    else:
        url = loopback_only(args.url)
    try:
        result = asyncio.run(run(args, url))
        result["after"] = wait_idle(url)
    finally:
        if server is not None:
            stack.close()

    print(
        f"\n{'kind':<18}{'n':>6}{'ok':>6}{'tokens':>8}{'p50 ms':>9}{'p99 ms':>9}{'ttft p50':>10} "
        " statuses"
    )
    for kind, r in result["kinds"].items():
        print(
            f"{kind:<18}{r['n']:>6}{r['ok']:>6}{r['tokens']:>8}{r['latency_ms']['p50']:>9.0f}"
            f"{r['latency_ms']['p99']:>9.0f}{r['ttft_ms']['p50']:>10.0f}  {r['status']}"
        )
    five = sum(
        n for r in result["kinds"].values() for s, n in r["status"].items() if s.startswith("5")
    )
    failed = not result["after"]["idle"] or five > 0 or result["transport_failures"]
    print(
        f"{sum(r['n'] for r in result['kinds'].values())} requests in {result['elapsed_s']:.1f}s; "
        f"5xx: {five}; transport failures: {len(result['transport_failures'])}; "
        f"idle with all KV blocks free afterwards: {result['after']['idle']}"
    )
    for f in result["transport_failures"]:
        print("  ", f)
    os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
    with open(args.json_out, "w") as f:
        json.dump({"args": vars(args), **result}, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
