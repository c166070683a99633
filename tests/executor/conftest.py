"""Tiny models for the multiprocess executor's tests, and helpers to run ranks with faults."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from streamkv import SamplingParams
from tests.models.hf_tiny import save_tiny

FAULTS_DIR = Path(__file__).parent / "faults"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="session")
def tiny4_dir(tmp_path_factory):
    """A 2-layer Llama with 4 query and 4 KV heads and an untied lm_head: splits at TP 2 and 4."""
    path = tmp_path_factory.mktemp("tiny-llama-kv4")
    save_tiny(LlamaConfig(
        vocab_size=1000, max_position_embeddings=256, num_hidden_layers=2, hidden_size=128,
        intermediate_size=256, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
    ), path)
    return path


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
