"""The client side of ``bench_serve.py``: streaming ``/v1/completions`` requests sent open-loop
at given times, and the figures vLLM's ``benchmark_serving`` prints from them (TTFT, TPOT,
ITL, throughput, goodput). aiohttp, as vLLM's client uses: one connection per request, no
pool limit, so a burst of N requests is N concurrent streams."""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class Result:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds from sending to the first streamed text
    latency: float = 0.0  # seconds from sending to the last byte
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks after the first
    status: int = 0


async def one_request(
    session, url: str, model: str, prompt: str, prompt_len: int, output_len: int, extra: dict
) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    res = Result(prompt_len=prompt_len)
    start = time.perf_counter()
    last = start
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            res.status = resp.status
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices")
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
            res.latency = time.perf_counter() - start
            res.ok = res.output_tokens > 0
            if not res.ok:
                res.error = "no usage chunk (stream ended early)"
    except Exception as e:  # a dropped connection is a failed request, not a crashed benchmark
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(
    url: str,
    model: str,
    requests: list[tuple[str, int, int]],
    arrivals: list[float],
    extra: dict | None = None,
    max_concurrency: int | None = None,
) -> tuple[float, list[Result]]:
    """Send ``requests`` [(prompt, prompt_len, output_len)] at ``arrivals`` (seconds from the
    start); returns (duration, results) where duration runs from the first send to the last
    answer."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()

        async def send(req, at: float) -> Result:
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if gate is None:
                return await one_request(session, url, model, *req, extra or {})
            async with gate:
                return await one_request(session, url, model, *req, extra or {})

        results = await asyncio.gather(
            *(send(r, a) for r, a in zip(requests, arrivals, strict=True))
        )
        return time.perf_counter() - t0, list(results)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:1000", "tpot:50"]`` -> {"ttft": 1.0, "tpot": 0.05} (milliseconds in, seconds
    out)."""
    out = {}
    for item in items or []:
        name, _, ms = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not ms:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        out[name] = float(ms) / 1e3
    return out


def summarize(duration: float, results: list[Result], slo: dict[str, float]) -> dict:
    """vLLM benchmark_serving's figures (times in ms)."""
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    ttft = [r.ttft for r in done]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    itl = [x for r in done for x in r.itl]

    def stats(name: str, xs: list[float]) -> dict:
        a = np.asarray(xs or [math.nan]) * 1e3
        return {
            f"mean_{name}_ms": float(a.mean()),
            f"median_{name}_ms": float(np.median(a)),
            f"p99_{name}_ms": float(np.percentile(a, 99)),
        }

    good = 0
    for r in done:
        r_tpot = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        if (
            r.ttft <= slo.get("ttft", math.inf)
            and r_tpot <= slo.get("tpot", math.inf)
            and r.latency <= slo.get("e2el", math.inf)
        ):
            good += 1
    errors = sorted({r.error for r in results if not r.ok})
    statuses: dict[str, int] = {}
    for r in results:  # HTTP status, or the exception of a request that got none
        key = str(r.status) if r.status else (r.error.split(":")[0] or "none")
        statuses[key] = statuses.get(key, 0) + 1
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": errors[:5],
        "statuses": statuses,
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "goodput_req_s": good / duration if slo else None,
        **stats("ttft", ttft),
        **stats("tpot", tpot),
        **stats("itl", itl),
    }


def print_summary(rate: float, s: dict) -> None:
    print(f"============ Serving Benchmark Result (rate {rate}) ============")
    rows = [
        ("Successful requests:", s["completed"]),
        ("Failed requests:", s["failed"]),
        ("Benchmark duration (s):", f"{s['duration_s']:.2f}"),
        ("Total input tokens:", s["total_input_tokens"]),
        ("Total generated tokens:", s["total_output_tokens"]),
        ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
        ("Total Token throughput (tok/s):", f"{s['total_token_throughput']:.2f}"),
    ]
    if s["goodput_req_s"] is not None:
        rows.append(("Request goodput (req/s):", f"{s['goodput_req_s']:.2f}"))
    for name, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
    ):
        rows += [
            (f"---{title}---", ""),
            (f"Mean {name.upper()} (ms):", f"{s[f'mean_{name}_ms']:.2f}"),
            (f"Median {name.upper()} (ms):", f"{s[f'median_{name}_ms']:.2f}"),
            (f"P99 {name.upper()} (ms):", f"{s[f'p99_{name}_ms']:.2f}"),
        ]
    for k, v in rows:
        print(f"{k:<42}{v:>12}")
    print(f"{'Answers by status:':<42}{s['statuses']}")
    if s["errors"]:
        print("errors:", *s["errors"], sep="\n  ")
