"""Tiny models for the multiprocess executor's tests, and helpers to run ranks with faults."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from streamkv import SamplingParams

FAULTS_DIR = Path(__file__).parent / "faults"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="session")
def tiny4_dir(tiny_llama):
    """A 2-layer Llama with 4 query and 4 KV heads and an untied lm_head: splits at TP 2 and 4."""
    return tiny_llama(
        hidden_size=128, intermediate_size=256, num_key_value_heads=4, tie_word_embeddings=False
    )


def tiny_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 990, (n,), generator=gen).tolist() for n in (3, 9, 21)]


def tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_faults(monkeypatch, faults: str) -> None:
    """Worker processes started from now on install ``faults`` (faults/sitecustomize.py)."""
    monkeypatch.setenv("STREAMKV_TEST_FAULTS", faults)
    monkeypatch.setenv("PYTHONPATH", str(FAULTS_DIR))
