"""The tiny Llama the CUDA worker tests share: 3 layers, 4 query / 2 KV heads of 64 (a head
size the CUDA kernels serve), untied lm_head, wide random weights (few near-ties)."""

from __future__ import annotations

import pytest

from tests.tiny_models import KERNEL_HEADS


@pytest.fixture(scope="session")
def tiny_dir(tiny_llama):
    return tiny_llama(
        **KERNEL_HEADS, max_position_embeddings=2048, num_hidden_layers=3, tie_word_embeddings=False
    )
