"""ModelInfo: the facts about the served model, resolved once when the engine starts and
passed down (engine, executors, workers), so no part re-reads config.json or re-derives the
context length on its own and no two parts can disagree about them.

A leaf: plain data and arithmetic on config numbers, no torch and no model code, so the
engine's process can validate a tensor-parallel size before any worker process starts.
``models.loader.resolve_model_info`` builds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model_dir: Path
    hf_config: dict[
        str, Any
    ]  # config.json as loaded (context capped at a sliding window); read-only
    vocab_size: int
    eos_token_ids: frozenset[int]  # config, generation_config.json and tokenizer, together
    max_model_len: int  # the served context length
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int

    @classmethod
    def from_config(
        cls,
        model_dir: Path,
        hf_config: dict[str, Any],
        max_model_len: int,
        eos_token_ids: frozenset[int],
    ) -> ModelInfo:
        heads = hf_config.get("num_attention_heads") or 0
        return cls(
            model_dir=Path(model_dir),
            hf_config=hf_config,
            vocab_size=int(hf_config["vocab_size"]),
            eos_token_ids=frozenset(eos_token_ids),
            max_model_len=max_model_len,
            num_layers=int(hf_config.get("num_hidden_layers") or 0),
            num_attention_heads=int(heads),
            num_kv_heads=int(hf_config.get("num_key_value_heads") or heads),
        )

    # -- the wire to worker processes (plain data) ----------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "model_dir": str(self.model_dir),
            "hf_config": self.hf_config,
            "max_model_len": self.max_model_len,
            "eos_token_ids": sorted(self.eos_token_ids),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelInfo:
        return cls.from_config(
            Path(data["model_dir"]),
            data["hf_config"],
            data["max_model_len"],
            frozenset(data["eos_token_ids"]),
        )

    def verify_tensor_parallel(self, tp: int) -> None:
        check_tensor_parallel(self.hf_config, tp)


def check_tensor_parallel(hf_config: dict[str, Any], tp: int) -> None:
    """Refuse, from config numbers alone, a tensor-parallel size the model cannot be split
    by: every rank holds whole attention and KV heads (KV heads are not replicated), a slice
    of the MLP, and a slice of an untied output projection."""
    if tp == 1:
        return
    c = hf_config
    heads = c.get("num_attention_heads") or 0
    kv_heads = c.get("num_key_value_heads") or heads
    if heads % tp or kv_heads % tp:
        raise ValueError(
            f"tensor_parallel_size {tp} must divide the model's {heads} attention heads and "
            f"{kv_heads} KV heads (every rank holds whole heads; replicating KV heads across "
            "ranks is not supported)"
        )
    mlp = c.get("intermediate_size") or c.get("ffn_dim") or 4 * (c.get("hidden_size") or 0)
    if mlp % tp:
        raise ValueError(
            f"tensor_parallel_size {tp} does not fit this model: its MLP width {mlp} "
            f"does not divide by {tp}"
        )
    # Llama-style configs default to an untied lm_head, OPT to a tied one (models/*.py).
    tied = c.get("tie_word_embeddings", c.get("model_type") == "opt")
    vocab = c.get("vocab_size") or 0
    if not tied and vocab % tp:
        raise ValueError(
            f"tensor_parallel_size {tp} does not fit this model: its untied output "
            f"projection's {vocab} rows do not divide by {tp}"
        )
