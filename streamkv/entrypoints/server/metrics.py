"""Prometheus metrics under vLLM's names (``vllm:*``, labels ``model_name`` and ``engine``)
so that dashboards and autoscalers built for vLLM read them, plus streamkv's own figures
under ``streamkv:*``. One registry per app: two apps in one process, as in tests, never
collide.

Time to first token, inter-token latency and end-to-end latency are observed here, on the
event loop as outputs arrive, so they are what a client sees (tokenization, queueing and
delivery included), as vLLM measures them too; the engine-side figures are read at scrape
time (engine_metrics.py).
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Counter, Histogram

from streamkv.engine.async_engine import AsyncEngine
from streamkv.engine.request_book import RequestStream
from streamkv.engine.stats import REQUEST_LATENCY_BUCKETS
from streamkv.entrypoints.server.engine_metrics import ENGINE_INDEX, LABELS, EngineCollector
from streamkv.sequence import RequestOutput


def observe_many(hist, amount: float, count: int) -> None:
    """``count`` observations of ``amount`` at the cost of one: on a loaded server the
    per-token observations of a late reader's output took 12% of the event loop (py-spy on
    the H200 host). Uses the labelled histogram's bucket counters; falls back to a loop."""
    bounds, buckets, total = (getattr(hist, a, None) for a in ("_upper_bounds", "_buckets", "_sum"))
    if bounds is None or buckets is None or total is None:
        for _ in range(count):
            hist.observe(amount)
        return
    total.inc(amount * count)
    for i, bound in enumerate(bounds):
        if amount <= bound:
            buckets[i].inc(count)
            break


# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = REQUEST_LATENCY_BUCKETS  # vLLM's request latency buckets, as the engine's
LOOP_LAG_BUCKETS = (
    0.0002,
    0.0005,
    0.001,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
)
FINISH_REASONS = ("stop", "length", "abort")


class ServerMetrics:
    """Also the AsyncEngine's observer: it sees every output on the event loop."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name))
        r, values = self.registry, (model_name, ENGINE_INDEX)

        def hist(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(name, doc, LABELS, registry=r, buckets=buckets).labels(*values)

        self.ttft = hist(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = hist(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        # vLLM keeps the older name (deprecated there in favour of the one above) with the
        # same observations; dashboards from before the rename read it.
        self.tpot = hist(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (same as inter_token_latency).",
            ITL_BUCKETS,
        )
        self.request_tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of a request's mean time per output token after the first.",
            ITL_BUCKETS,
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            E2E_BUCKETS,
        )
        self._success = Counter(
            "vllm:request_success",
            "Count of finished requests by finish reason.",
            [*LABELS, "finished_reason"],
            registry=r,
        )
        self.loop_lag = Histogram(
            "streamkv:event_loop_lag_seconds",
            "How late the event loop runs a timer (sampled every 10 ms).",
            ["model_name"],
            registry=r,
            buckets=LOOP_LAG_BUCKETS,
        ).labels(model_name)
        self.values = values
        for reason in FINISH_REASONS:
            self._success.labels(*values, reason)
        engine.observers.append(self)

    def on_output(self, stream: RequestStream, out: RequestOutput, now: float) -> None:
        ntok = len(out.outputs[0].token_ids) if out.outputs else 0
        new = ntok - stream.num_tokens_seen
        if new > 0:
            if stream.first_token_time is None:
                stream.first_token_time = stream.last_token_time = now
                self.ttft.observe(now - stream.arrival)
                new -= 1  # the first token has no gap before it
            if new > 0:
                # Outputs are cumulative: a late reader gets several tokens at once, each one
                # an equal share of the gap (one observation per token, as vLLM counts them).
                gap = (now - stream.last_token_time) / new
                observe_many(self.itl, gap, new)
                observe_many(self.tpot, gap, new)
            stream.last_token_time, stream.num_tokens_seen = now, ntok
        if out.finished:
            self.e2e.observe(now - stream.arrival)
            if ntok > 1 and stream.first_token_time is not None:
                self.request_tpot.observe(
                    (stream.last_token_time - stream.first_token_time) / (ntok - 1)
                )
            reason = out.outputs[0].finish_reason if out.outputs and not out.error else "abort"
            self._success.labels(*self.values, reason or "abort").inc()

    def on_abort(self, stream: RequestStream, now: float) -> None:
        self.e2e.observe(now - stream.arrival)
        self._success.labels(*self.values, "abort").inc()

    async def watch_loop_lag(self, interval: float = 0.01) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(interval)
            self.loop_lag.observe(max(time.perf_counter() - t0 - interval, 0.0))
