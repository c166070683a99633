"""Prometheus metrics with vLLM's v0 names under a ``streamkv:`` prefix, in a registry of
the app's own (two apps in one process, as in tests, never collide).

Engine-side figures (queues, cache usage, token counters) are read at scrape time from the
snapshot the engine thread publishes; per-request latencies are observed on the event loop
as outputs arrive, so they are what a client sees (queueing and delivery included).
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from streamkv.engine.async_engine import AsyncEngine, RequestStream
from streamkv.sequence import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
LOOP_LAG_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02,
                    0.03, 0.05, 0.1, 0.25, 0.5, 1.0)


class _EngineCollector:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine, self.labels = engine, [model_name]

    def collect(self):
        s, info = self.engine.stats, self.engine.info
        if not s or info is None:
            return
        for name, key, doc in (
            ("num_requests_running", "num_running", "Requests on the GPU (or CPU device) this step."),
            ("num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
            ("num_requests_swapped", "num_swapped", "Requests swapped out to CPU memory."),
        ):
            yield self._gauge(name, doc, s[key])
        yield self._gauge("gpu_cache_usage_perc", "Fraction of device KV blocks in use (1 = full).",
                          _used(s["num_kv_blocks"], s["num_free_kv_blocks"]))
        yield self._gauge("cpu_cache_usage_perc", "Fraction of CPU swap blocks in use (1 = full).",
                          _used(s["num_swap_blocks"], s["num_free_swap_blocks"]))
        yield self._gauge("pinned_kv_blocks", "Device KV blocks pinned by reserved prefixes (never evicted).",
                          s.get("num_pinned_kv_blocks", 0))
        for name, key, doc in (
            ("num_preemptions", "num_preemptions", "Cumulative number of preemptions."),
            ("prompt_tokens", "num_prompt_tokens", "Prompt tokens computed (prefill, recompute)."),
            ("generation_tokens", "num_generation_tokens", "Generated tokens."),
        ):
            c = CounterMetricFamily(f"streamkv:{name}", doc, labels=["model_name"])
            c.add_metric(self.labels, s[key])
            yield c
        yield from self._kv_waste(s)
        g = GaugeMetricFamily("streamkv:cache_config_info", "KV cache configuration.",
                              labels=["block_size", "num_gpu_blocks", "num_cpu_blocks"])
        g.add_metric([str(info.block_size), str(info.num_kv_blocks), str(info.num_swap_blocks)], 1)
        yield g

    def _kv_waste(self, s: dict):
        """The paper's Fig 2 and Fig 13 figures: averages since start as gauges, and their
        sums and sample counts as counters, so a client can average over its own window
        (the difference of two scrapes). Absent for an engine that does not account (a fake)."""
        if "kv_waste_samples" not in s:
            return
        kinds = ("token", "reserved", "internal", "external")
        share = GaugeMetricFamily("streamkv:kv_memory_share",
                                  "Time-averaged share of the held KV memory by kind: token states, reserved "
                                  "for future tokens, internal and external fragmentation.",
                                  labels=["model_name", "kind", "kv_allocation"])
        share_sum = CounterMetricFamily("streamkv:kv_memory_share_sum",
                                        "Sum over sampled steps of the KV memory share by kind.",
                                        labels=["model_name", "kind", "kv_allocation"])
        for kind in kinds:
            labels = [*self.labels, kind, s["kv_allocation"]]
            share.add_metric(labels, s[f"kv_{kind}_share"])
            share_sum.add_metric(labels, s["kv_waste_share_sums"][kind])
        yield share
        yield share_sum
        c = CounterMetricFamily("streamkv:kv_memory_samples", "Steps sampled for the KV memory shares.",
                                labels=["model_name"])
        c.add_metric(self.labels, s["kv_waste_samples"])
        yield c
        yield self._gauge("batched_requests_avg", "Average number of requests batched in a step.",
                          s["avg_batched_requests"])
        for name, key, doc in (
            ("batched_requests_sum", "batched_requests_sum", "Sum over steps of the requests batched."),
            ("batched_steps", "batched_steps", "Steps that ran at least one request."),
        ):
            c = CounterMetricFamily(f"streamkv:{name}", doc, labels=["model_name"])
            c.add_metric(self.labels, s[key])
            yield c

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(f"streamkv:{name}", doc, labels=["model_name"])
        g.add_metric(self.labels, value)
        return g


def _used(total: int, free: int) -> float:
    return (total - free) / total if total else 0.0


class ServerMetrics:
    """Also the AsyncEngine's observer: it sees every output on the event loop."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        r, lab = self.registry, ["model_name"]
        self.ttft = Histogram("streamkv:time_to_first_token_seconds", "Time to first token.",
                              lab, registry=r, buckets=_LATENCY_BUCKETS).labels(model_name)
        self.tpot = Histogram("streamkv:time_per_output_token_seconds", "Time per output token.",
                              lab, registry=r, buckets=_TPOT_BUCKETS).labels(model_name)
        self.e2e = Histogram("streamkv:e2e_request_latency_seconds", "End-to-end request latency.",
                             lab, registry=r, buckets=_E2E_BUCKETS).labels(model_name)
        self._success = Counter("streamkv:request_success", "Finished requests by finish reason.",
                                [*lab, "finished_reason"], registry=r)
        self.loop_lag = Histogram("streamkv:event_loop_lag_seconds",
                                  "How late the event loop runs a timer (sampled every 10 ms).",
                                  lab, registry=r, buckets=LOOP_LAG_BUCKETS).labels(model_name)
        self.model_name = model_name
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)
        engine.observers.append(self)

    def on_output(self, stream: RequestStream, out: RequestOutput, now: float) -> None:
        ntok = len(out.outputs[0].token_ids) if out.outputs else 0
        if ntok > stream.num_tokens_seen:
            if stream.first_token_time is None:
                stream.first_token_time = now
                self.ttft.observe(now - stream.arrival)
            else:
                self.tpot.observe((now - stream.last_token_time) / (ntok - stream.num_tokens_seen))
            stream.last_token_time, stream.num_tokens_seen = now, ntok
        if out.finished:
            self.e2e.observe(now - stream.arrival)
            reason = out.outputs[0].finish_reason if out.outputs and not out.error else "abort"
            self._success.labels(self.model_name, reason or "abort").inc()

    def on_abort(self, stream: RequestStream, now: float) -> None:
        self.e2e.observe(now - stream.arrival)
        self._success.labels(self.model_name, "abort").inc()

    async def watch_loop_lag(self, interval: float = 0.01) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(interval)
            self.loop_lag.observe(max(time.perf_counter() - t0 - interval, 0.0))
