"""The operator's log lines (engine/serving_logs.py): the periodic stats line and the
per-request line, from stats dicts of known values."""

from __future__ import annotations

import logging

import pytest

from streamkv.engine.serving_logs import StatsLogger, log_request
from streamkv.sampling_params import SamplingParams


def _stats(prompt=0, gen=0, queries=0, hits=0, running=0, free=100):
    return {
        "num_prompt_tokens": prompt,
        "num_generation_tokens": gen,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "num_running": running,
        "num_waiting": 1,
        "num_swapped": 0,
        "num_kv_blocks": 100,
        "num_free_kv_blocks": free,
    }


def test_stats_line_rates_over_its_interval(caplog):
    caplog.set_level(logging.DEBUG, "streamkv.stats")
    log = StatsLogger(interval=5.0)
    log.maybe_log(_stats(), 100.0)
    log.maybe_log(_stats(prompt=50, gen=10), 103.0)  # before the interval: nothing
    assert not caplog.records
    log.maybe_log(_stats(prompt=100, gen=20, queries=80, hits=20, running=2, free=75), 110.0)
    (rec,) = caplog.records
    assert rec.levelno == logging.INFO
    assert rec.getMessage() == (
        "prompt 10.0 tok/s, generation 2.0 tok/s | running 2, waiting 1, swapped 0 reqs | "
        "KV cache 25.0% used | prefix-cache hit rate 25.0%"
    )


def test_an_idle_engine_logs_at_debug_after_one_last_info_line(caplog):
    caplog.set_level(logging.DEBUG, "streamkv.stats")
    log = StatsLogger(interval=1.0)
    log.maybe_log(_stats(), 0.0)
    log.maybe_log(_stats(gen=5), 1.0)  # busy
    log.maybe_log(_stats(gen=5), 2.0)  # idle, but the interval before was busy: still INFO
    log.maybe_log(_stats(gen=5), 3.0)  # idle twice: DEBUG
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO, logging.DEBUG]
    assert (
        caplog.records[-1].getMessage().endswith("prefix-cache hit rate -")
    )  # no queries: no rate


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="> 0"):
        StatsLogger(interval=0)


def test_request_line_has_no_prompt_text_at_info(caplog):
    caplog.set_level(logging.INFO, "streamkv.requests")
    log_request("req-1", [1, 2, 3], SamplingParams(max_tokens=7), "secret prompt")
    (rec,) = caplog.records
    assert (
        rec.getMessage().startswith("request req-1: 3 prompt tokens, SamplingParams(")
        and "max_tokens=7" in rec.getMessage()
    )
    assert "secret" not in rec.getMessage()
    caplog.clear()
    caplog.set_level(logging.DEBUG, "streamkv.requests")
    log_request("req-2", [1], SamplingParams(), "secret prompt")
    assert any(
        "secret prompt" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records
    )
