"""The model-facts record: resolved once at engine start, frozen, handed to the executor and
its worker; the caller's config is never changed; tensor-parallel sizes are checked from
config numbers alone."""

from __future__ import annotations

import dataclasses
import json

import pytest

from streamkv import LLM
from streamkv.config import ModelConfig
from streamkv.entrypoints.args import engine_config
from streamkv.model_info import ModelInfo, check_tensor_parallel
from streamkv.models.loader import resolve_model_info


def test_facts_resolved_from_the_model_dir(tiny_llama_dir, tmp_path):
    info = resolve_model_info(ModelConfig(model=str(tiny_llama_dir)))
    assert (info.vocab_size, info.max_model_len, info.num_attention_heads, info.num_kv_heads) == (
        1000,
        256,
        4,
        2,
    )
    assert info.model_dir == tiny_llama_dir
    assert (
        resolve_model_info(ModelConfig(model=str(tiny_llama_dir), max_model_len=64)).max_model_len
        == 64
    )
    with pytest.raises(ValueError, match="exceeds the model's context length 256"):
        resolve_model_info(ModelConfig(model=str(tiny_llama_dir), max_model_len=512))
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.max_model_len = 1  # type: ignore[misc]
    # EOS ids gather config.json and generation_config.json.
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((tiny_llama_dir / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert resolve_model_info(ModelConfig(model=str(tmp_path))).eos_token_ids == {7, 9} | (
        {cfg["eos_token_id"]} if isinstance(cfg.get("eos_token_id"), int) else set()
    )
    assert ModelInfo.from_dict(info.to_dict()) == info  # what a worker process receives


def test_the_engine_shares_one_record_and_leaves_the_config_alone(tiny_llama_dir):
    config = engine_config(
        str(tiny_llama_dir), device="cpu", num_kv_blocks=16, num_swap_blocks=0, max_model_len=100
    )
    before = dataclasses.asdict(config)
    from streamkv.engine.llm_engine import LLMEngine

    engine = LLMEngine(config)
    try:
        assert dataclasses.asdict(config) == before  # never mutated after verify()
        assert engine.model_info.max_model_len == 100 == engine.info().max_model_len
        assert engine.executor.worker.model_info is engine.model_info
        assert engine.info().vocab_size == 1000 and engine.num_waiting() == 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "config, tp, match",
    [
        (
            {
                "num_attention_heads": 9,
                "num_key_value_heads": 3,
                "intermediate_size": 64,
                "vocab_size": 64,
            },
            2,
            "must divide the model's 9 attention heads and 3 KV heads",
        ),
        (
            {
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 129,
                "vocab_size": 64,
            },
            2,
            "its MLP width 129",
        ),
        (
            {
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 64,
                "vocab_size": 101,
            },
            2,
            "untied output projection's 101 rows",
        ),
    ],
)
def test_tensor_parallel_sizes_are_checked_from_config_numbers(config, tp, match):
    with pytest.raises(ValueError, match=match):
        check_tensor_parallel({"model_type": "llama", **config}, tp)


def test_a_tied_or_fitting_model_passes():
    check_tensor_parallel(
        {"model_type": "opt", "num_attention_heads": 4, "ffn_dim": 64, "vocab_size": 101}, 2
    )
    check_tensor_parallel({"num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 7}, 1)


def test_bad_tensor_parallel_size_is_refused_before_any_worker(tiny_llama_dir, monkeypatch):
    def no_executor(*args, **kwargs):
        raise AssertionError("an executor was created")

    monkeypatch.setattr("streamkv.engine.llm_engine.create_executor", no_executor)
    with pytest.raises(
        ValueError, match="must divide the model's 4 attention heads and 2 KV heads"
    ):
        LLM(str(tiny_llama_dir), device="cpu", tensor_parallel_size=4, num_kv_blocks=8)
