"""One source for engine arguments: the CLI flags and LLM(**kwargs) come from the config
dataclasses' fields (entrypoints/args.py)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from streamkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from streamkv.entrypoints.args import (
    GROUP_TITLES,
    add_engine_args,
    engine_config,
    engine_fields,
    engine_kwargs,
)


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
    defaults = engine_kwargs(_parser().parse_args([]))
    assert defaults == {name: f.default for name, (_, f, _) in fields.items()}
    # Parsing nothing gives the dataclasses' own defaults.
    assert engine_config(None, **engine_kwargs(_parser().parse_args([]))) == EngineConfig(
        ModelConfig(), CacheConfig(), SchedulerConfig()
    )


def test_flags_reach_the_config():
    args = _parser().parse_args(
        [
            "--block-size",
            "8",
            "--no-enable-prefix-caching",
            "-tp",
            "2",
            "--max-num-batched-tokens",
            "512",
            "--preemption-mode",
            "swap",
            "--enforce-eager",
            "--swap-space",
            "1.5",
            "--kv-allocation",
            "orca-max",
        ]
    )
    config = engine_config("m", **engine_kwargs(args))
    assert (config.model.model, config.model.tensor_parallel_size, config.model.enforce_eager) == (
        "m",
        2,
        True,
    )
    assert (
        config.cache.block_size,
        config.cache.enable_prefix_caching,
        config.cache.swap_space,
    ) == (8, False, 1.5)
    assert config.cache.kv_allocation == "orca-max"
    assert (config.scheduler.max_num_batched_tokens, config.scheduler.preemption_mode) == (
        512,
        "swap",
    )
    with pytest.raises(SystemExit):
        _parser().parse_args(["--preemption-mode", "sometimes"])  # choices from the config


def test_unknown_keyword_is_refused_by_name():
    with pytest.raises(TypeError, match="frobnicate"):
        engine_config(None, frobnicate=1)
    # The derived context length is no argument: max_model_len is the model's request.
    assert engine_config(None, max_model_len=64).model.max_model_len == 64


def test_repeatable_field_is_an_appending_flag_and_a_tuple():
    assert engine_kwargs(_parser().parse_args([]))["reserved_prefix"] == ()
    args = _parser().parse_args(["--reserved-prefix", "a.txt", "--reserved-prefix", "b.txt"])
    assert engine_config(None, **engine_kwargs(args)).cache.reserved_prefix == ("a.txt", "b.txt")


def test_flags_are_grouped_by_config_section_in_help():
    text = _parser().format_help()
    for title in GROUP_TITLES.values():
        assert title in text
    # A flag sits in its own section's group: --block-size after the cache title, before the
    # scheduler's.
    cache, sched = text.index(GROUP_TITLES["cache"]), text.index(GROUP_TITLES["scheduler"])
    assert cache < text.index("\n  --block-size") < sched < text.index("\n  --max-num-seqs")


def test_swap_space_defaults_to_none_on_a_cpu_and_four_gib_on_a_gpu():
    # A CPU "swap" pool would duplicate the KV pool in the same RAM (issue 14).
    cache = engine_config(None).cache
    assert cache.swap_space is None
    assert (cache.swap_space_gib("cpu"), cache.swap_space_gib("cuda")) == (0.0, 4.0)
    explicit = engine_config(None, swap_space=1.5).cache
    assert (explicit.swap_space_gib("cpu"), explicit.swap_space_gib("cuda")) == (1.5, 1.5)
    with pytest.raises(ValueError, match="swap_space"):
        engine_config(None, swap_space=-1.0).verify()


def test_tokenizer_flag_must_name_a_local_directory(tmp_path):
    args = _parser().parse_args(["--tokenizer", str(tmp_path)])
    config = engine_config(None, **engine_kwargs(args))
    assert config.model.tokenizer == str(tmp_path)
    config.verify()
    with pytest.raises(ValueError, match="tokenizer must be a local directory"):
        engine_config(None, tokenizer=str(tmp_path / "missing")).verify()


def test_max_logprobs_flag_reaches_the_config():
    args = _parser().parse_args(["--max-logprobs", "3"])
    assert engine_config(None, **engine_kwargs(args)).model.max_logprobs == 3
