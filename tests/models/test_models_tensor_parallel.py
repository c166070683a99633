"""The models are tensor-parallel ready: two CPU ranks (gloo over loopback, rendezvous through
a file) each load their shard of the same checkpoint, and their logits equal the unsharded
model's. Exercises column/row sharding of fused q/k/v and gate/up, KV-head splitting under
GQA, row-parallel biases (added once) and the gathered lm_head."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch
from hf_tiny import save_tiny
from tp_rank import IDS, WORLD, prefill_logits, run_rank
from transformers import LlamaConfig, OPTConfig, Qwen2Config

from streamkv.models.registry import build_model

pytestmark = pytest.mark.slow  # two rank processes

COMMON = {
    "vocab_size": 1000,
    "max_position_embeddings": 128,
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
}
CONFIGS = {
    "llama": lambda: LlamaConfig(
        **COMMON, intermediate_size=128, num_key_value_heads=2, attention_bias=True
    ),
    "qwen2": lambda: Qwen2Config(
        **COMMON, intermediate_size=128, num_key_value_heads=2, tie_word_embeddings=True
    ),
    "opt": lambda: OPTConfig(
        **COMMON, ffn_dim=128, word_embed_proj_dim=32, tie_word_embeddings=False
    ),
}


def test_two_ranks_match_one(tmp_path):
    names = sorted(CONFIGS)
    for name in names:
        # Sharded on disk too, so shards of a checkpoint feed shards of the model.
        save_tiny(CONFIGS[name](), tmp_path / name, max_shard_size="60KB")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=run_rank, args=(r, str(tmp_path), names)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    for name in names:
        full = prefill_logits(
            build_model(Path(tmp_path / name), torch.float32, torch.device("cpu")), IDS
        )
        for r in range(WORLD):
            sharded = torch.load(tmp_path / f"{name}.rank{r}.pt")
            torch.testing.assert_close(sharded, full, rtol=1e-4, atol=1e-4, msg=f"{name} rank {r}")
