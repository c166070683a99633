"""One run's figures from its RequestRecords, whatever driver filled them.

- TTFT: scheduled arrival -> first streamed tokens. TPOT: (e2e - TTFT) / (tokens per
  sample - 1). ITL: gaps between successive deliveries of one request. E2E: arrival -> last
  token. Each reported as mean and p50 / p90 / p99 (ms), over the requests that finished.
- Normalized latency (the paper's metric): mean over finished requests of e2e latency ÷
  the request's output length (per sample), in seconds per token.
- Goodput: finished requests per second that met every given SLO (vLLM's definition).
- Throughput: output (and total) tokens per second over the run; request rate achieved:
  finished requests per second; send lag: how late the harness sent (its own health).
"""

from __future__ import annotations

import numpy as np

from load_tests.runner import RequestRecord

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft", "tpot", "e2e", "norm")  # ms; norm in ms per output token


def parse_slo(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "norm:200"]`` -> {"ttft": 500.0, "norm": 200.0} (milliseconds)."""
    slo = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"an SLO is KEY:MILLISECONDS with KEY one of {SLO_KEYS}, got {item!r}")
        try:
            slo[key] = float(value)
        except ValueError:
            raise ValueError(f"not a number of milliseconds: {item!r}") from None
        if not slo[key] > 0:
            raise ValueError(f"an SLO must be > 0 ms, got {item!r}")
    return slo


def _dist(values: list[float], scale: float = 1e3) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in PERCENTILES}}
    a = np.asarray(values) * scale
    return {"mean": float(a.mean()), **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}}


def per_request(rec: RequestRecord) -> dict[str, float | None]:
    """Latencies of one finished request, in seconds (None where it streamed nothing)."""
    e2e = rec.end - rec.scheduled
    per_sample = max(rec.output_tokens // max(rec.n, 1), 1)
    ttft = rec.chunk_times[0] - rec.scheduled if rec.chunk_times else None
    tpot = (e2e - ttft) / (per_sample - 1) if ttft is not None and per_sample > 1 else None
    return {"e2e": e2e, "ttft": ttft, "tpot": tpot, "norm": e2e / per_sample}


def summarize(
    records: list[RequestRecord], duration: float, slo: dict[str, float] | None = None
) -> dict:
    done = [r for r in records if r.ok]
    lat = [per_request(r) for r in done]
    itl = [b - a for r in done for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    good = 0
    for m in lat:
        if all(m[k] is not None and m[k] * 1e3 <= v for k, v in (slo or {}).items()):
            good += 1
    duration = max(duration, 1e-9)
    return {
        "num_requests": len(records),
        "completed": len(done),
        "errors": sum(1 for r in records if r.error is not None),
        "incomplete": sum(1 for r in records if r.incomplete),
        "error_examples": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": _dist([m["ttft"] for m in lat if m["ttft"] is not None]),
        "tpot_ms": _dist([m["tpot"] for m in lat if m["tpot"] is not None]),
        "itl_ms": _dist(itl),
        "e2e_ms": _dist([m["e2e"] for m in lat]),
        "normalized_latency_s": float(np.mean([m["norm"] for m in lat])) if lat else float("nan"),
        "slo_ms": dict(slo or {}),
        "goodput": good / duration if slo else None,
        "send_lag_ms": _dist([r.sent - r.scheduled for r in records if r.sent is not None]),
    }
