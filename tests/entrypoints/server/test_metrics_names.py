"""/metrics under vLLM's names and labels (issue 14), against a real ``streamkv serve``.

VLLM_METRICS is vLLM's documented list, as exposed (counters with their ``_total``):
the Production Metrics page (https://docs.vllm.ai/en/stable/usage/metrics/) and the
definitions it is generated from, ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``,
labels ``model_name`` and ``engine``; buckets), plus ``vllm:num_requests_swapped`` of
vLLM v0 (``vllm/engine/metrics.py``), which streamkv still has: it swaps to CPU memory.
Left out: speculative decoding, LoRA and KV-connector metrics (streamkv has none of them).
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.conftest import run_server

VLLM_METRICS = {
    # name as exposed -> Prometheus type
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_swapped": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:cache_config_info": "gauge",
}
# vLLM's bucket bounds (loggers.py), for the histograms whose bounds do not depend on max_model_len.
VLLM_BUCKETS = {
    "vllm:time_to_first_token_seconds": [
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
    ],
    "vllm:inter_token_latency_seconds": [
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
    ],
    "vllm:e2e_request_latency_seconds": [
        0.3,
        0.5,
        0.8,
        1.0,
        1.5,
        2.0,
        2.5,
        5.0,
        10.0,
        15.0,
        20.0,
        30.0,
        40.0,
        50.0,
        60.0,
        120.0,
        240.0,
        480.0,
        960.0,
        1920.0,
        7680.0,
    ],
    "vllm:iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    "vllm:request_params_n": [1, 2, 5, 10, 20],
    # 1-2-5 up to max_model_len (1024 here)
    "vllm:request_prompt_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000],
}
STREAMKV_EXTRAS = (
    "streamkv:kv_memory_share",
    "streamkv:kv_memory_samples",
    "streamkv:cpu_cache_usage_perc",
    "streamkv:event_loop_lag_seconds",
    "streamkv:batched_requests_avg",
)
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def scraped():
    """Families after a chat and a two-sample completion, and what the client was told."""
    with run_server() as server:
        usage = []
        for body, path in (
            (
                {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
                "chat/completions",
            ),
            ({"prompt": "The sky is", "max_tokens": 2, "n": 2, "temperature": 0.8}, "completions"),
        ):
            r = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=120)
            assert r.status_code == 200, r.text
            usage.append(r.json()["usage"])
        server.wait_idle()
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}, usage


@pytest.mark.slow
def test_every_vllm_metric_is_exported_with_vllms_labels(scraped):
    families, _ = scraped
    missing = sorted(set(VLLM_METRICS) - set(families))
    assert not missing, missing
    for name, kind in VLLM_METRICS.items():
        family = families[name]
        assert family.type == kind, (name, family.type)
        assert family.samples, name
        for sample in family.samples:
            if name == "vllm:cache_config_info":
                assert {"block_size", "num_gpu_blocks", "num_cpu_blocks", "engine"} <= set(
                    sample.labels
                )
            else:
                assert sample.labels["model_name"] == MODEL and sample.labels["engine"] == "0", (
                    sample
                )
    for name in STREAMKV_EXTRAS:
        assert name in families, name
    assert not [
        n for n in families if n.startswith("streamkv:num_requests")
    ]  # no duplicates of vLLM's


@pytest.mark.slow
def test_histogram_buckets_are_vllms(scraped):
    families, _ = scraped
    for name, bounds in VLLM_BUCKETS.items():
        les = [s.labels["le"] for s in families[name].samples if s.name.endswith("_bucket")]
        assert les == [*map(str, map(float, bounds)), "+Inf"], name


@pytest.mark.slow
def test_values_agree_with_what_the_client_was_told(scraped):
    families, usage = scraped

    def value(name: str, suffix: str = "", **labels) -> float:
        return sum(
            s.value
            for s in families[name].samples
            if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items())
        )

    prompt = sum(u["prompt_tokens"] for u in usage)
    completion = sum(u["completion_tokens"] for u in usage)
    assert value("vllm:request_prompt_tokens", "_sum") == prompt
    assert value("vllm:request_prompt_tokens", "_count") == 2
    assert value("vllm:request_generation_tokens", "_sum") == completion
    assert value("vllm:prompt_tokens", "_total") >= prompt  # recomputation would add to it
    assert value("vllm:request_params_n", "_sum") == 3  # n=1 and n=2
    assert value("vllm:request_params_max_tokens", "_sum") == 5
    assert (
        value("vllm:request_success", "_total", finished_reason="length")
        + value("vllm:request_success", "_total", finished_reason="stop")
        == 2
    )
    assert value("vllm:time_to_first_token_seconds", "_count") == 2
    assert value("vllm:e2e_request_latency_seconds", "_count") == 2
    assert value("vllm:prefix_cache_queries", "_total") >= prompt
    # The request intervals add up: queue + inference = arrival to last token, inference =
    # prefill + decode (engine-side clocks, summed over both requests).
    inference = value("vllm:request_inference_time_seconds", "_sum")
    assert inference == pytest.approx(
        value("vllm:request_prefill_time_seconds", "_sum")
        + value("vllm:request_decode_time_seconds", "_sum"),
        rel=1e-6,
    )
    assert 0 < inference <= value("vllm:e2e_request_latency_seconds", "_sum")
    assert value("vllm:kv_cache_usage_perc") == 0  # idle: every block free again
