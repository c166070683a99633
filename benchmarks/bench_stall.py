"""How long one hostile request can stall other streams (issue 26's bound): a real
`streamkv serve`, N victim streams generating, then hostile requests sent one after another
(extreme sampling numbers, oversized and slow-to-compile grammars, huge stop lists). For
each hostile request: its answer (status and time) and the longest gap any victim stream saw
while it was in flight, against the victims' longest gap before any was sent. Prints a table
and writes JSON.

    python benchmarks/bench_stall.py --victims 8 --json-out bench_results/stall.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def hostile_requests() -> list[tuple[str, dict]]:
    """(name, body of /v1/completions), the issue's cases and their neighbours."""
    props = {f"p{i}": {"type": "integer"} for i in range(5000)}
    many = {"type": "object", "properties": props, "required": list(props)}
    return [
        ("top_p 1e-46", {"top_p": 1e-46, "temperature": 1.0}),
        ("temperature 1e308", {"temperature": 1e308}),
        ("logit_bias 1e308", {"logit_bias": {"42": 1e308}}),
        (
            "regex of 1 MB",
            {
                "structured_outputs": {
                    "regex": "(" + "|".join(f"w{i}" for i in range(150_000)) + ")"
                }
            },
        ),
        (
            "enum of 10,000 strings",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "e",
                        "schema": {"enum": [f"v{i}" for i in range(10_000)]},
                    },
                }
            },
        ),
        (
            "5,000 required properties",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": many},
                }
            },
        ),
        (
            "minLength 10^6",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "m",
                        "schema": {"type": "string", "minLength": 1_000_000},
                    },
                }
            },
        ),
        (
            "2,000 anyOf branches",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "a",
                        "schema": {"anyOf": [{"const": f"c{i}"} for i in range(2000)]},
                    },
                }
            },
        ),
        ("a{0,1000000}", {"structured_outputs": {"regex": "a{0,1000000}"}}),
        (
            "$ref to a file",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "r", "schema": {"$ref": "file:///etc/passwd"}},
                }
            },
        ),
        ("1,000 stop strings", {"stop": [f"s{i}" for i in range(1000)]}),
    ]


async def victim(session, url: str, gaps: list[tuple[float, float]], stop: asyncio.Event) -> None:
    """Streams completions until ``stop``; records (time, gap since the last chunk)."""
    while not stop.is_set():
        body = {
            "prompt": "Tell me a long story about the sea.",
            "max_tokens": 400,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
        }
        async with session.post(f"{url}/v1/completions", json=body) as r:
            last = time.perf_counter()
            async for line in r.content:
                if stop.is_set():
                    break
                if line.startswith(b"data: {"):
                    now = time.perf_counter()
                    gaps.append((now, now - last))
                    last = now


async def run(url: str, victims: int, settle: float) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        gaps: list[tuple[float, float]] = []
        stop = asyncio.Event()
        tasks = [asyncio.create_task(victim(session, url, gaps, stop)) for _ in range(victims)]
        await asyncio.sleep(settle)
        t_base = time.perf_counter()
        baseline = max((g for t, g in gaps if t > t_base - settle / 2), default=float("nan"))
        rows = []
        for name, extra in hostile_requests():
            body = {"prompt": "x", "max_tokens": 8, **extra}
            t0 = time.perf_counter()
            async with session.post(f"{url}/v1/completions", json=body) as r:
                text = await r.text()
                status = r.status
            t1 = time.perf_counter()
            await asyncio.sleep(0.5)  # the victims' next chunk after the answer counts too
            worst = max((g for t, g in gaps if t0 <= t <= t1 + 0.5), default=float("nan"))
            error = json.loads(text).get("error", {}) if status != 200 else {}
            rows.append(
                {
                    "request": name,
                    "status": status,
                    "param": error.get("param"),
                    "message": (error.get("message") or "")[:160],
                    "answer_s": t1 - t0,
                    "worst_victim_gap_s": worst,
                }
            )
            print(
                f"{name:<28}{status:>5} {error.get('param') or '':<22}{t1 - t0:>8.2f} s  "
                f"worst victim gap {worst:.2f} s",
                flush=True,
            )
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"victims": victims, "baseline_worst_gap_s": baseline, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--victims", type=int, default=8)
    ap.add_argument("--settle", type=float, default=10.0, help="seconds of victims alone first")
    ap.add_argument("--model", default=None)
    ap.add_argument("--server-args", default="")
    ap.add_argument("--json-out", default="bench_results/stall.json")
    args = ap.parse_args()
    import shlex

    from streamkv.bench.server_process import start_server

    ns = argparse.Namespace(
        model=args.model,
        engine_args="",
        server_args=args.server_args,
        server_tree=None,
        startup_timeout=900.0,
    )
    log = open(f"/tmp/bench-stall-{os.getpid()}.log", "w")  # noqa: SIM115
    proc, url = start_server(ns, log)
    try:
        result = asyncio.run(run(url, args.victims, args.settle))
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
    result["server_args"] = shlex.split(args.server_args)
    worst = max(
        (
            r["worst_victim_gap_s"]
            for r in result["rows"]
            if r["worst_victim_gap_s"] == r["worst_victim_gap_s"]
        ),
        default=float("nan"),
    )  # nan: no victim chunk came while that request was in flight
    result["worst_victim_gap_s"] = worst
    print(
        f"victims alone: worst gap {result['baseline_worst_gap_s']:.2f} "
        "s; with a hostile request in "
        f"flight: worst {worst:.2f} s"
    )
    os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
    with open(args.json_out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
