"""The engine-side metrics, read at scrape time from the snapshot the engine thread
publishes (engine/stats.py): queues, cache usage, token counters, the queue / prefill /
decode time histograms, and streamkv's KV-waste figures by kind and swap-pool usage.
"""

from __future__ import annotations

import itertools

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from streamkv.engine.async_engine import AsyncEngine

LABELS = ["model_name", "engine"]
ENGINE_INDEX = "0"  # one engine per server (vLLM numbers its data-parallel engines)

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


class EngineCollector:
    """Reads the engine's published snapshot at scrape time (nothing per step or token)."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine, self.labels = engine, [model_name, ENGINE_INDEX]

    def collect(self):
        s, info = self.engine.stats, self.engine.info
        if not s or info is None:
            return
        yield from self._queue_gauges(s)
        yield from self._counters(s)
        for key, snap in s.get("histograms", {}).items():
            name, doc = _ENGINE_HISTOGRAMS[key]
            yield _histogram(name, doc, self.labels, snap)
        yield _cache_config(info)
        yield from self._pool_gauges(s)
        yield from self._kv_waste(s)

    def _queue_gauges(self, s: dict):
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

    def _counters(self, s: dict):
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

    def _pool_gauges(self, s: dict):
        """streamkv's own: the CPU swap pool's usage, and the blocks reserved prefixes pin."""
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


def _cache_config(info) -> GaugeMetricFamily:
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
