"""Prometheus metrics under vLLM's names (``vllm:*``, labels ``model_name`` and ``engine``)
so that dashboards and autoscalers built for vLLM read them, plus streamkv's own figures
under ``streamkv:*`` (KV waste by kind, swap-pool usage, event-loop lag). One registry per
app: two apps in one process, as in tests, never collide.

Engine-side figures (queues, cache usage, token counters, the queue / prefill / decode time
histograms) are read at scrape time from the snapshot the engine thread publishes
(engine/stats.py); time to first token, inter-token latency and end-to-end latency are
observed on the event loop as outputs arrive, so they are what a client sees (tokenization,
queueing and delivery included), as vLLM measures them too.
"""

from __future__ import annotations

import asyncio
import itertools
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from streamkv.engine.async_engine import AsyncEngine
from streamkv.engine.request_book import RequestStream
from streamkv.engine.stats import REQUEST_LATENCY_BUCKETS
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
LABELS = ["model_name", "engine"]
ENGINE_INDEX = "0"  # one engine per server (vLLM numbers its data-parallel engines)
FINISH_REASONS = ("stop", "length", "abort")

# Engine histograms (engine/stats.py key) -> vLLM name and help.
_ENGINE_HISTOGRAMS = {
    "iteration_tokens": (
        "vllm:iteration_tokens_total",
        "Histogram of number of tokens per engine step.",
    ),
    "queue_time": (
        "vllm:request_queue_time_seconds",
        "Time from arrival to the first step that ran the request.",
    ),
    "prefill_time": (
        "vllm:request_prefill_time_seconds",
        "Time from first scheduled to the first token.",
    ),
    "decode_time": ("vllm:request_decode_time_seconds", "Time from the first token to the last."),
    "inference_time": (
        "vllm:request_inference_time_seconds",
        "Time from first scheduled to the last token.",
    ),
    "prompt_tokens": ("vllm:request_prompt_tokens", "Prompt tokens of a finished request."),
    "generation_tokens": (
        "vllm:request_generation_tokens",
        "Generated tokens of a finished request.",
    ),
    "params_n": ("vllm:request_params_n", "Histogram of the n request parameter."),
    "params_max_tokens": (
        "vllm:request_params_max_tokens",
        "Histogram of the max_tokens request parameter.",
    ),
}


class _EngineCollector:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine, self.labels = engine, [model_name, ENGINE_INDEX]

    def collect(self):
        s, info = self.engine.stats, self.engine.info
        if not s or info is None:
            return
        for name, key, doc in (
            (
                "num_requests_running",
                "num_running",
                "Number of requests in model execution batches.",
            ),
            ("num_requests_waiting", "num_waiting", "Number of requests waiting to be processed."),
            ("num_requests_swapped", "num_swapped", "Number of requests swapped to CPU."),
        ):
            yield self._gauge(f"vllm:{name}", doc, s[key])
        yield self._gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            _used(s["num_kv_blocks"], s["num_free_kv_blocks"]),
        )
        for name, key, doc in (
            (
                "num_preemptions",
                "num_preemptions",
                "Cumulative number of preemptions from the engine.",
            ),
            (
                "prompt_tokens",
                "num_prompt_tokens",
                "Number of prefill tokens processed (recomputation included).",
            ),
            (
                "generation_tokens",
                "num_generation_tokens",
                "Number of generation tokens processed.",
            ),
            (
                "prefix_cache_queries",
                "prefix_cache_queries",
                "Prefix cache queries, in queried tokens.",
            ),
            ("prefix_cache_hits", "prefix_cache_hits", "Prefix cache hits, in cached tokens."),
        ):
            if key not in s:  # an engine without a prefix cache account (the tests' fake)
                continue
            c = CounterMetricFamily(f"vllm:{name}", doc, labels=LABELS)
            c.add_metric(self.labels, s[key])
            yield c
        for key, snap in s.get("histograms", {}).items():
            name, doc = _ENGINE_HISTOGRAMS[key]
            yield _histogram(name, doc, self.labels, snap)
        labels = {
            "block_size": str(info.block_size),
            "num_gpu_blocks": str(info.num_kv_blocks),
            "num_cpu_blocks": str(info.num_swap_blocks),
            "enable_prefix_caching": str(info.prefix_caching),
            "engine": ENGINE_INDEX,
        }
        g = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the engine's cache config.",
            labels=list(labels),
        )
        g.add_metric(list(labels.values()), 1)
        yield g
        yield self._gauge(
            "streamkv:cpu_cache_usage_perc",
            "Fraction of CPU swap blocks in use (1 = full).",
            _used(s["num_swap_blocks"], s["num_free_swap_blocks"]),
            self.labels[:1],
            ["model_name"],
        )
        if "num_pinned_kv_blocks" in s:
            yield self._gauge(
                "streamkv:pinned_kv_blocks",
                "KV blocks pinned by reserved prefixes (never evicted).",
                s["num_pinned_kv_blocks"],
                self.labels[:1],
                ["model_name"],
            )
        yield from self._kv_waste(s)

    def _kv_waste(self, s: dict):
        """The paper's Fig 2 and Fig 13 figures: averages since start as gauges, and their
        sums and sample counts as counters, so a client can average over its own window
        (the difference of two scrapes). Absent for an engine that does not account (a fake)."""
        if "kv_waste_samples" not in s:
            return
        model = self.labels[:1]
        kinds = ("token", "reserved", "internal", "external")
        share = GaugeMetricFamily(
            "streamkv:kv_memory_share",
            "Time-averaged share of the held KV memory by kind: token states, reserved "
            "for future tokens, internal and external fragmentation.",
            labels=["model_name", "kind", "kv_allocation"],
        )
        share_sum = CounterMetricFamily(
            "streamkv:kv_memory_share_sum",
            "Sum over sampled steps of the KV memory share by kind.",
            labels=["model_name", "kind", "kv_allocation"],
        )
        for kind in kinds:
            labels = [*model, kind, s["kv_allocation"]]
            share.add_metric(labels, s[f"kv_{kind}_share"])
            share_sum.add_metric(labels, s["kv_waste_share_sums"][kind])
        yield share
        yield share_sum
        c = CounterMetricFamily(
            "streamkv:kv_memory_samples",
            "Steps sampled for the KV memory shares.",
            labels=["model_name"],
        )
        c.add_metric(model, s["kv_waste_samples"])
        yield c
        yield self._gauge(
            "streamkv:batched_requests_avg",
            "Average number of requests batched in a step.",
            s["avg_batched_requests"],
            model,
            ["model_name"],
        )
        for name, key, doc in (
            (
                "batched_requests_sum",
                "batched_requests_sum",
                "Sum over steps of the requests batched.",
            ),
            ("batched_steps", "batched_steps", "Steps that ran at least one request."),
        ):
            c = CounterMetricFamily(f"streamkv:{name}", doc, labels=["model_name"])
            c.add_metric(model, s[key])
            yield c

    def _gauge(
        self,
        name: str,
        doc: str,
        value: float,
        values: list[str] | None = None,
        labels: list[str] | None = None,
    ) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=labels or LABELS)
        g.add_metric(values or self.labels, value)
        return g


def _histogram(name: str, doc: str, labels: list[str], snap: dict) -> HistogramMetricFamily:
    cumulative = list(itertools.accumulate(snap["counts"]))
    buckets = [(_le(b), c) for b, c in zip(snap["bounds"], cumulative)] + [("+Inf", cumulative[-1])]
    h = HistogramMetricFamily(name, doc, labels=LABELS)
    h.add_metric(labels, buckets, snap["sum"])
    return h


def _le(bound: float) -> str:
    return repr(float(bound))  # "1.0", "0.3": the form prometheus_client writes for its own


def _used(total: int, free: int) -> float:
    return (total - free) / total if total else 0.0


class ServerMetrics:
    """Also the AsyncEngine's observer: it sees every output on the event loop."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
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
