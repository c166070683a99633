"""Greedy parity with transformers for every supported architecture and variant: a tiny
random model is saved with ``save_pretrained`` (safetensors, no tokenizer) and served by
streamkv from that directory, prompts given as token ids."""

from __future__ import annotations

import json

import pytest
import torch
from hf_tiny import greedy_compare, prompts, save_tiny
from transformers import LlamaConfig, MistralConfig, OPTConfig, Qwen2Config

from streamkv.entrypoints.llm import LLM
from streamkv.models.loader import has_tokenizer_files
from tests.tiny_models import TINY_LLAMA

VOCAB = 1000
NO_SPECIAL = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
LLAMA = {**TINY_LLAMA, "vocab_size": VOCAB, **NO_SPECIAL}
OPT = {
    "hidden_size": 64,
    "ffn_dim": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": VOCAB,
    "max_position_embeddings": 256,
    "word_embed_proj_dim": 64,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": 1,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so the tiny head_dim has low, medium (smoothed) and high frequencies.
    "original_max_position_embeddings": 64,
}

CASES = {
    "llama-gqa": lambda: LlamaConfig(**LLAMA),
    "llama-biases": lambda: LlamaConfig(**LLAMA, attention_bias=True, mlp_bias=True),
    "llama3-rope-scaling": lambda: LlamaConfig(**LLAMA, rope_parameters=LLAMA3_ROPE),
    "smollm2-tied": lambda: LlamaConfig(
        **{**LLAMA, "num_attention_heads": 3, "num_key_value_heads": 1, "hidden_size": 48},
        tie_word_embeddings=True,
    ),
    "mistral": lambda: MistralConfig(**LLAMA, head_dim=32, rope_theta=1e6),
    "qwen2-tied": lambda: Qwen2Config(**LLAMA, tie_word_embeddings=True),
    "qwen2": lambda: Qwen2Config(**{**LLAMA, "num_key_value_heads": 4}),
    "opt": lambda: OPTConfig(**OPT),
    "opt-project-in-out": lambda: OPTConfig(**{**OPT, "word_embed_proj_dim": 32}),
    "opt-post-layernorm": lambda: OPTConfig(**OPT, do_layer_norm_before=False),
    "opt-350m-style": lambda: OPTConfig(
        **{**OPT, "word_embed_proj_dim": 32}, do_layer_norm_before=False
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_matches_transformers(case, tmp_path):
    hf = save_tiny(CASES[case](), tmp_path)
    llm = LLM(
        str(tmp_path),
        device="cpu",
        dtype="float32",
        block_size=8,
        num_kv_blocks=64,
        num_swap_blocks=0,
    )
    assert not has_tokenizer_files(tmp_path)  # the engine runs on token ids alone
    result = greedy_compare(hf, llm, prompts(VOCAB), max_tokens=12)
    # A near-tie is legal but should be rare with these weights; many means a real bug.
    assert result.exact >= 4, result


def test_qwen2_has_qkv_bias_but_no_o_bias(tmp_path):
    save_tiny(Qwen2Config(**LLAMA), tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=8, num_swap_blocks=0)
    attn = llm.engine.executor.worker.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None


def test_sharded_checkpoint(tmp_path):
    hf = save_tiny(LlamaConfig(**LLAMA), tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    shards = json.loads((tmp_path / "model.safetensors.index.json").read_text())[
        "weight_map"
    ].values()
    assert len(set(shards)) > 1
    llm = LLM(
        str(tmp_path),
        device="cpu",
        dtype="float32",
        block_size=16,
        num_kv_blocks=32,
        num_swap_blocks=0,
    )
    assert greedy_compare(hf, llm, prompts(VOCAB, lengths=(3, 20)), max_tokens=8).exact >= 1


def test_mistral_sliding_window_caps_the_context(tmp_path):
    """Within the window, full attention is sliding-window attention: streamkv serves
    contexts up to the window exactly, and refuses longer ones up front."""
    hf = save_tiny(MistralConfig(**LLAMA, sliding_window=40), tmp_path)
    with pytest.raises(ValueError, match="exceeds the model's context length 40"):
        LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=32, num_swap_blocks=0)
    assert llm.engine.model_info.max_model_len == 40 == llm.engine.info().max_model_len
    # 30 prompt tokens + 10 generated = the whole window.
    assert greedy_compare(hf, llm, prompts(VOCAB, lengths=(30, 12)), max_tokens=10).exact >= 1


def test_bfloat16_runs_close_to_float32(tmp_path):
    """Lower precision loads and runs (weights cast while streaming in)."""
    save_tiny(LlamaConfig(**LLAMA), tmp_path)
    ids = prompts(VOCAB, lengths=(6,))
    ref = LLM(str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=8, num_swap_blocks=0)
    low = LLM(str(tmp_path), device="cpu", dtype="bfloat16", num_kv_blocks=8, num_swap_blocks=0)
    assert next(low.engine.executor.worker.model.parameters()).dtype == torch.bfloat16
    from streamkv import SamplingParams

    p = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    assert (
        ref.generate(None, p, prompt_token_ids=ids)[0].outputs[0].token_ids
        == low.generate(None, p, prompt_token_ids=ids)[0].outputs[0].token_ids
    )
