"""The tiny Llama the CUDA worker tests share: 3 layers, 4 query / 2 KV heads of 64 (a head
size the CUDA kernels serve), untied lm_head, wide random weights (few near-ties)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_dir(tiny_llama):
    return tiny_llama(
        max_position_embeddings=2048,
        num_hidden_layers=3,
        hidden_size=256,
        intermediate_size=512,
        head_dim=64,
        tie_word_embeddings=False,
    )
