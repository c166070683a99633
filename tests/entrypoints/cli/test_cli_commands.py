"""``streamkv generate`` and ``streamkv chat`` as a newcomer types them: the model as a
positional argument (as ``serve`` takes it), user errors as one line without a traceback,
tokens/s after the text; and ``llm.stats()`` printed as a summary."""

from __future__ import annotations

import subprocess
import sys

import pytest

from streamkv.entrypoints.cli.main import build_parser, main, parse_args
from streamkv.entrypoints.llm import EngineStats
from tests.entrypoints.conftest import run_server

SMALL = [
    "--device",
    "cpu",
    "--num-kv-blocks",
    "64",
    "--num-swap-blocks",
    "0",
    "--max-model-len",
    "512",
]


def _parse(*argv: str):
    return parse_args(build_parser(), list(argv))


def test_generate_takes_the_model_as_serve_does():
    a = _parse("generate", "./my-model", "Hello there")
    assert (a.model, a.prompt) == ("./my-model", "Hello there")
    a = _parse("generate", "Hello there")
    assert (a.model, a.prompt) == (None, "Hello there")
    assert _parse("generate", "Hello", "--model", "./old-spelling").model_flag == "./old-spelling"


def test_generate_user_errors_are_one_line(capsys):
    assert main(["generate", "./a", "hi", "--model", "./b"]) == 2
    err = capsys.readouterr().err
    assert err == "error: the model is given twice ('./a' and --model './b')\n", err
    assert main(["generate", "/no/such/model", "hi", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: model '/no/such/model' is not a local directory"), err
    assert not any("Traceback" in line for line in err)


def test_chat_without_a_server_says_so_in_one_line():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "streamkv.entrypoints.cli",
            "chat",
            "--url",
            "http://127.0.0.1:9",
            "-q",
            "hi",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert (
        r.stderr.strip()
        == "error: no server at http://127.0.0.1:9 (start one with `streamkv serve`, or give --url)"
    )


def test_stats_print_as_a_summary_and_stay_a_dict():
    raw = {
        "num_kv_blocks": 2912,
        "num_free_kv_blocks": 2900,
        "num_swap_blocks": 0,
        "num_free_swap_blocks": 0,
        "num_preemptions": 1,
        "num_swapped_out_blocks": 0,
        "num_swapped_in_blocks": 0,
        "peak_kv_blocks_used": 40,
        "kv_utilization": 0.012,
        "num_cow_copies": 3,
        "num_shared_blocks": 2,
        "sharing_savings": 0.25,
        "prefix_cache_queries": 200,
        "prefix_cache_hits": 50,
        "num_prompt_tokens": 200,
        "num_generation_tokens": 640,
        "num_running": 0,
        "num_waiting": 0,
        "num_swapped": 0,
        "kv_allocation": "paged",
        "avg_batched_requests": 3.5,
        "batched_steps": 180,
        "histograms": {"x": [1] * 500},
    }
    stats = EngineStats(raw)
    assert stats == raw and stats["num_cow_copies"] == 3
    text = repr(stats)
    assert len(text.splitlines()) <= 8 and "histograms" not in text
    assert (
        "2,912 blocks" in text
        and "3 copy-on-write copies" in text
        and "50 of 200 prompt tokens found (25.0 %)" in text
    )
    assert "640 generated" in text and "preemptions: 1" in text
    assert str(stats) == text


@pytest.mark.slow
def test_generate_prints_the_text_then_tokens_per_second():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "streamkv.entrypoints.cli",
            "--log-level",
            "WARNING",
            "generate",
            "The capital of France is",
            "--max-tokens",
            "6",
            *SMALL,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("[6 tokens in ") and "tok/s after the first" in last, last


@pytest.fixture(scope="module")
def server():
    with run_server() as s:
        yield s


@pytest.mark.slow
def test_chat_talks_to_a_running_server(server):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "streamkv.entrypoints.cli",
            "chat",
            "--url",
            server.url,
            "-q",
            "Say hello.",
            "--max-tokens",
            "5",
            "--temperature",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert r.stderr.strip().startswith("[5 tokens in "), r.stderr
    # A conversation over stdin: two turns, /reset, /exit.
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "streamkv.entrypoints.cli",
            "chat",
            "--url",
            server.url,
            "--max-tokens",
            "3",
            "--temperature",
            "0",
        ],
        input="Hi\nAnd again\n/reset\n/exit\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("[3 tokens in ") == 2 and "(the conversation is forgotten)" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("quick", ["/reset", "  "])
def test_chat_quick_is_one_turn_whatever_it_says(server, quick):
    # --quick once looped for ever on a line that sends nothing (it re-read the same text).
    r = subprocess.run(
        [sys.executable, "-m", "streamkv.entrypoints.cli", "chat"]
        + ["--url", server.url, "-q", quick],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert not r.stdout.strip()
