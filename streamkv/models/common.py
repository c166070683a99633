"""Shape parameters read from a Hugging Face config, shared by every architecture."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ModelShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    norm_eps: float

    @classmethod
    def from_config(cls, c: dict) -> ModelShape:
        heads = c["num_attention_heads"]
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c.get("intermediate_size") or c.get("ffn_dim") or 4 * c["hidden_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            max_positions=c.get("max_position_embeddings", 2048),
            norm_eps=c.get("rms_norm_eps", c.get("layer_norm_eps", 1e-5)) or 1e-5,
        )


def rope_settings(c: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from either the transformers 4.x or 5.x config spelling."""
    params = c.get("rope_parameters") or {}
    theta = c.get("rope_theta") or params.get("rope_theta") or 10000.0
    scaling = c.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return float(theta), scaling
