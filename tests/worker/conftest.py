"""The tiny Llama the CUDA worker tests share: 3 layers, 4 query / 2 KV heads of 64 (a head
size the CUDA kernels serve), untied lm_head, wide random weights (few near-ties)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from transformers import LlamaConfig

    from tests.models.hf_tiny import save_tiny

    path = tmp_path_factory.mktemp("tiny-llama-cuda")
    save_tiny(LlamaConfig(
        vocab_size=1000, max_position_embeddings=2048, num_hidden_layers=3, hidden_size=256,
        intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        tie_word_embeddings=False,
    ), path)
    return path
