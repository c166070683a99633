"""Shared fixtures: one engine on the embedded model per configuration, reused across tests
(loading takes seconds), and the no-leak invariant checked after every test that used one."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# `make test` (so CI) draws the same property-test examples on every run (derandomized, no
# example database): a red run then means the code changed, not the draw. A plain pytest
# run keeps drawing new examples and replays its own failures from .hypothesis/, which is
# where new cases come from (each found one goes into its test as an @example).
settings.register_profile("ci", derandomize=True, database=None)
settings.load_profile(os.environ.get("STREAMKV_HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session")
def hf_model_dir():
    from streamkv.models.loader import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def hf_model(hf_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_model_dir), dtype=torch.float32)
    model.eval()
    return model


_ENGINES: dict = {}


@pytest.fixture(scope="session")
def make_llm():
    """make_llm(**kwargs) -> a cached LLM for that configuration."""
    from streamkv.entrypoints.llm import LLM

    def make(**kwargs):
        key = tuple(sorted(kwargs.items()))
        if key not in _ENGINES:
            _ENGINES[key] = LLM(**kwargs)
        return _ENGINES[key]

    yield make
    _ENGINES.clear()


@pytest.fixture(autouse=True)
def _no_leaked_blocks():
    yield
    for llm in _ENGINES.values():
        bm = llm.engine.block_manager
        bm.check_no_leaks()
