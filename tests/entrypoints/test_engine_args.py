"""One source for engine arguments: the CLI flags and LLM(**kwargs) come from the config
dataclasses' fields (entrypoints/args.py)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from streamkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from streamkv.entrypoints.args import add_engine_args, engine_config, engine_fields, engine_kwargs


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def test_every_config_field_is_a_flag_with_its_default_and_help():
    fields = engine_fields()
    for cls in (ModelConfig, CacheConfig, SchedulerConfig):
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli", True):
                assert f.name in fields and f.metadata.get("help"), f.name
    defaults = vars(_parser().parse_args([]))
    assert defaults == {name: f.default for name, (_, f, _) in fields.items()}
    # Parsing nothing gives the dataclasses' own defaults.
    assert engine_config(None, **engine_kwargs(_parser().parse_args([]))) == EngineConfig(
        ModelConfig(), CacheConfig(), SchedulerConfig())


def test_flags_reach_the_config():
    args = _parser().parse_args([
        "--block-size", "8", "--no-enable-prefix-caching", "-tp", "2", "--max-num-batched-tokens", "512",
        "--preemption-mode", "swap", "--enforce-eager", "--swap-space", "1.5", "--kv-allocation", "orca-max",
    ])
    config = engine_config("m", **engine_kwargs(args))
    assert (config.model.model, config.model.tensor_parallel_size, config.model.enforce_eager) == ("m", 2, True)
    assert (config.cache.block_size, config.cache.enable_prefix_caching, config.cache.swap_space) == (8, False, 1.5)
    assert config.cache.kv_allocation == "orca-max"
    assert (config.scheduler.max_num_batched_tokens, config.scheduler.preemption_mode) == (512, "swap")
    with pytest.raises(SystemExit):
        _parser().parse_args(["--preemption-mode", "sometimes"])  # choices from the config


def test_unknown_keyword_is_refused_by_name():
    with pytest.raises(TypeError, match="frobnicate"):
        engine_config(None, frobnicate=1)
    # The derived context length is no argument: max_model_len is the model's request.
    assert engine_config(None, max_model_len=64).model.max_model_len == 64
