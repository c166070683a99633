"""What a serving engine tells its operator in the log: a periodic stats line (vLLM's
``LoggingStatLogger``: throughput, queues, KV usage, prefix-cache hit rate) and, when asked,
one line per request. Both read only what the engine already publishes (``stats()``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from streamkv.sampling_params import SamplingParams

logger = logging.getLogger("streamkv.stats")
request_logger = logging.getLogger("streamkv.requests")

DEFAULT_STATS_INTERVAL_S = 5.0  # vLLM's


@dataclass(slots=True)
class _Mark:
    time: float
    prompt_tokens: int
    generation_tokens: int
    prefix_queries: int
    prefix_hits: int


class StatsLogger:
    """Call ``maybe_log(stats, now)`` after every refresh of the engine's stats; it writes
    one line per ``interval`` seconds, rates over that interval. An idle engine (no tokens
    in this interval or the one before) logs at DEBUG, so a quiet server keeps a quiet log."""

    def __init__(self, interval: float = DEFAULT_STATS_INTERVAL_S) -> None:
        if not interval > 0:
            raise ValueError(f"the stats interval must be > 0 s, got {interval}")
        self.interval = interval
        self._mark: _Mark | None = None
        self._was_busy = False

    def maybe_log(self, stats: dict, now: float) -> None:
        mark = _Mark(
            now,
            stats["num_prompt_tokens"],
            stats["num_generation_tokens"],
            stats.get("prefix_cache_queries", 0),
            stats.get("prefix_cache_hits", 0),
        )
        last = self._mark
        if last is None:
            self._mark = mark
            return
        dt = now - last.time
        if dt < self.interval:
            return
        self._mark = mark
        prompt_tps = (mark.prompt_tokens - last.prompt_tokens) / dt
        gen_tps = (mark.generation_tokens - last.generation_tokens) / dt
        busy = bool(prompt_tps or gen_tps)
        level = logging.INFO if busy or self._was_busy else logging.DEBUG
        self._was_busy = busy
        if not logger.isEnabledFor(level):
            return
        total, free = stats["num_kv_blocks"], stats["num_free_kv_blocks"]
        queries = mark.prefix_queries - last.prefix_queries
        hit_rate = (
            f"{100 * (mark.prefix_hits - last.prefix_hits) / queries:.1f}%" if queries else "-"
        )
        logger.log(
            level,
            "prompt %.1f tok/s, generation %.1f tok/s | running %d, waiting %d, swapped %d reqs | "
            "KV cache %.1f%% used | prefix-cache hit rate %s",
            prompt_tps,
            gen_tps,
            stats["num_running"],
            stats["num_waiting"],
            stats["num_swapped"],
            100 * (total - free) / total if total else 0.0,
            hit_rate,
        )


def log_request(
    request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None
) -> None:
    """One INFO line per request (``--enable-log-requests``): the prompt's text only at DEBUG,
    since prompts may hold what an operator's log should not keep."""
    request_logger.info(
        "request %s: %d prompt tokens, %s", request_id, len(prompt_token_ids), params
    )
    if prompt is not None:
        request_logger.debug("request %s prompt: %r", request_id, prompt)
