"""A tiny random Llama shared by the engine tests that need a model but not its quality."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_llama):
    return tiny_llama()
