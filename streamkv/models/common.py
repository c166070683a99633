"""What every architecture shares: shape parameters read from a Hugging Face config, the
rope settings in either transformers spelling, the sliding-window context limit, and
streaming a checkpoint into (possibly fused, possibly sharded) parameters."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from streamkv.layers.linear import ParallelLinear

logger = logging.getLogger(__name__)


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
        missing = [
            k
            for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
            if not c.get(k)
        ]
        if missing:
            raise ValueError(f"config.json lacks {missing}")
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim")
        if not head_dim:
            if c["hidden_size"] % heads:
                raise ValueError(f"hidden_size {c['hidden_size']} does not divide by {heads} heads")
            head_dim = c["hidden_size"] // heads
        kv_heads = c.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError(f"{heads} attention heads do not divide into {kv_heads} KV heads")
        # Llama, Mistral and Qwen2 default to 1e-6 in transformers; OPT's nn.LayerNorm to 1e-5.
        eps = (
            c.get("rms_norm_eps")
            or c.get("layer_norm_eps")
            or (1e-5 if c.get("model_type") == "opt" else 1e-6)
        )
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            # OPT names its MLP width ffn_dim.
            intermediate_size=c.get("intermediate_size")
            or c.get("ffn_dim")
            or 4 * c["hidden_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            max_positions=c.get("max_position_embeddings") or 2048,
            norm_eps=float(eps),
        )


def rope_settings(c: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from either the transformers 4.x (``rope_theta`` + ``rope_scaling``)
    or 5.x (``rope_parameters``) config spelling."""
    params = c.get("rope_parameters") or {}
    theta = c.get("rope_theta") or params.get("rope_theta") or 10000.0
    scaling = c.get("rope_scaling") or (
        params if params.get("rope_type", "default") != "default" else None
    )
    return float(theta), scaling


def sliding_window(c: dict) -> int | None:
    """The attention window of any layer, or None when every layer attends to everything."""
    window = c.get("sliding_window")
    if not window:
        return None
    # Qwen2 keeps a sliding_window value even while use_sliding_window is off.
    if "use_sliding_window" in c and not c["use_sliding_window"]:
        return None
    layer_types = c.get("layer_types")
    if layer_types and "sliding_attention" not in layer_types:
        return None
    return int(window)


def limit_context_to_window(c: dict) -> dict:
    """Cap ``max_position_embeddings`` at the sliding window (returns a new dict).

    Paged attention here always attends to the whole context. For a context no longer than
    the window, sliding-window attention sees exactly the same keys, so capping the
    servable length at the window keeps outputs exact instead of silently diverging past it.
    """
    window = sliding_window(c)
    limit = c.get("max_position_embeddings") or 2048
    if window is None or window >= limit:
        return c
    logger.warning(
        "sliding_window %d < max_position_embeddings %d: serving contexts of at most %d tokens, "
        "where full attention equals sliding-window attention",
        window,
        limit,
        window,
    )
    return {**c, "max_position_embeddings": window}


def embedding(num: int, dim: int, dtype: torch.dtype, device) -> nn.Embedding:
    """An embedding table allocated on ``device`` without its default (CPU-slow) init."""
    emb = torch.nn.utils.skip_init(nn.Embedding, num, dim, dtype=dtype, device=device)
    emb.weight.requires_grad_(False)
    return emb


def load_checkpoint(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: Callable[[str], str | None],
    fused: dict[str, tuple[str, int]],
) -> None:
    """Stream Hugging Face tensors into ``model``'s parameters, one tensor at a time.

    ``rename`` maps a checkpoint name to a parameter name (None: skip it); ``fused`` maps a
    checkpoint module name to (fused module name, part), e.g. ``q_proj -> (qkv_proj, 0)``.
    Every parameter must be filled completely (each part of a fused one), or this raises.
    """
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    done: set[tuple[str, int]] = set()
    for hf_name, tensor in weights:
        name = rename(hf_name)
        if name is None:
            continue
        mod_name, _, leaf = name.rpartition(".")
        parent, _, last = mod_name.rpartition(".")
        part = 0
        if last in fused:
            target, part = fused[last]
            mod_name = f"{parent}.{target}" if parent else target
        module = modules.get(mod_name)
        if isinstance(module, ParallelLinear) and leaf in ("weight", "bias"):
            module.load_part(part, tensor, is_bias=leaf == "bias")
        elif name in params:
            if params[name].shape != tensor.shape:
                raise ValueError(
                    f"{hf_name}: shape {tuple(tensor.shape)} "
                    f"!= expected {tuple(params[name].shape)}"
                )
            params[name].data.copy_(tensor)
        else:
            raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
        done.add((f"{mod_name}.{leaf}", part))
    missing = []
    for name in params:
        mod_name = name.rpartition(".")[0]
        module = modules[mod_name]
        parts = len(module.out_splits) if isinstance(module, ParallelLinear) else 1
        missing += [name for p in range(parts) if (name, p) not in done][:1]
    if missing:
        raise ValueError(f"weights missing from checkpoint: {sorted(missing)[:8]}")
