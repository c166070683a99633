"""A tiny random Llama shared by the engine tests that need a model but not its quality."""

from __future__ import annotations

import pytest

TINY_LLAMA = dict(
    vocab_size=1000, max_position_embeddings=256, num_hidden_layers=2, hidden_size=64,
    intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from transformers import LlamaConfig

    from tests.models.hf_tiny import save_tiny

    path = tmp_path_factory.mktemp("tiny-llama-engine")
    save_tiny(LlamaConfig(**TINY_LLAMA), path)
    return path
