"""OPT (the PagedAttention paper's model family) on block tables: learned positional
embeddings looked up at ``position + 2`` (fairseq reserved the first two rows), multi-head
attention and MLP with biases, ReLU, tied lm_head.

Variants, read from config.json:
- ``do_layer_norm_before`` (default): pre-LayerNorm blocks and a final LayerNorm;
  ``False`` (opt-350m): post-LayerNorm blocks and no final LayerNorm.
- ``word_embed_proj_dim != hidden_size`` (opt-350m): token embeddings live in the smaller
  width; ``project_in`` lifts them to hidden_size and ``project_out`` brings the final
  hidden state back before the (tied) lm_head.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from streamkv.kernels import gemv
from streamkv.layers.attention import AttentionMetadata, PagedAttention
from streamkv.layers.linear import ParallelLinear
from streamkv.layers.norm import LayerNorm
from streamkv.models.common import ModelShape, embedding, load_checkpoint
from streamkv.models.llama import tp_heads

POSITION_OFFSET = 2
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}


class OPTAttention(nn.Module):
    def __init__(self, s: ModelShape, bias: bool, **kw) -> None:
        super().__init__()
        self.num_heads, _ = tp_heads(s.num_heads, s.num_heads, kw["tp_size"])
        self.head_dim = s.head_dim
        size = s.num_heads * s.head_dim
        self.qkv_proj = ParallelLinear(s.hidden_size, [size, size, size], bias=bias, **kw)
        self.out_proj = ParallelLinear(size, [s.hidden_size], bias=bias, parallel="row", **kw)
        self.attn = PagedAttention(self.num_heads, self.num_heads, s.head_dim, s.head_dim**-0.5)

    def forward(self, x: torch.Tensor, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)
        out = self.attn(q, k, v, kv_cache, meta)
        return self.out_proj(out.reshape(t, self.num_heads * self.head_dim))


class OPTDecoderLayer(nn.Module):
    def __init__(self, s: ModelShape, config: dict, **kw) -> None:
        super().__init__()
        bias = bool(config.get("enable_bias", True))
        ln = {
            "eps": s.norm_eps,
            "affine": bool(config.get("layer_norm_elementwise_affine", True)),
            "dtype": kw["dtype"],
            "device": kw["device"],
        }
        self.pre_norm = bool(config.get("do_layer_norm_before", True))
        self.act = _ACTIVATIONS[config.get("activation_function", "relu")]
        self.self_attn = OPTAttention(s, bias, **kw)
        self.self_attn_layer_norm = LayerNorm(s.hidden_size, **ln)
        self.fc1 = ParallelLinear(s.hidden_size, [s.intermediate_size], bias=bias, **kw)
        self.fc2 = ParallelLinear(
            s.intermediate_size, [s.hidden_size], bias=bias, parallel="row", **kw
        )
        self.final_layer_norm = LayerNorm(s.hidden_size, **ln)

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(h)))  # fc1's bias is in its GEMM

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, kv_cache, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pre-LN: returns (the MLP output, the residual stream before it is added), the next
        norm adding the two, fused (as the Llama layers do); the first layer gets residual
        None. Post-LN: returns (the layer's normalised output, None)."""
        if not self.pre_norm:  # x = LN(x + attn(x)); x = LN(x + mlp(x))
            h, _ = self.self_attn_layer_norm(self.self_attn(x, kv_cache, meta), x)
            out, _ = self.final_layer_norm(self._mlp(h), h)
            return out, None
        if residual is None:
            residual, h = x, self.self_attn_layer_norm(x)
        else:
            h, residual = self.self_attn_layer_norm(x, residual)
        h, residual = self.final_layer_norm(self.self_attn(h, kv_cache, meta), residual)
        return self._mlp(h), residual


class OPTForCausalLM(nn.Module):
    def __init__(
        self,
        config: dict,
        shape: ModelShape,
        tp_rank=0,
        tp_size=1,
        dtype=torch.float32,
        device="cpu",
    ):
        super().__init__()
        act = config.get("activation_function", "relu")
        if act not in _ACTIVATIONS:
            raise ValueError(
                f"OPT activation_function {act!r} is not "
                f"supported (supported: {sorted(_ACTIVATIONS)})"
            )
        kw = {"tp_rank": tp_rank, "tp_size": tp_size, "dtype": dtype, "device": device}
        self.config, self.shape, self.tp_size = config, shape, tp_size
        hidden = shape.hidden_size
        embed_dim = config.get("word_embed_proj_dim") or hidden
        self.embed_tokens = embedding(shape.vocab_size, embed_dim, dtype, device)
        self.embed_positions = embedding(
            shape.max_positions + POSITION_OFFSET, hidden, dtype, device
        )
        # The projections are small (hidden x embed_dim) and sit outside the layers: replicate.
        dd = {"dtype": dtype, "device": device}
        projected = embed_dim != hidden
        self.project_in = ParallelLinear(embed_dim, [hidden], **dd) if projected else None
        self.project_out = ParallelLinear(hidden, [embed_dim], **dd) if projected else None
        self.layers = nn.ModuleList(
            OPTDecoderLayer(shape, config, **kw) for _ in range(shape.num_layers)
        )
        pre_norm = bool(config.get("do_layer_norm_before", True))
        # _remove_final_layer_norm: transformers' switch for a few old checkpoints.
        self.final_layer_norm = (
            LayerNorm(
                hidden,
                shape.norm_eps,
                bool(config.get("layer_norm_elementwise_affine", True)),
                **dd,
            )
            if pre_norm and not config.get("_remove_final_layer_norm", False)
            else None
        )
        # transformers' OPTConfig ties the lm_head to the token embeddings unless told not to.
        self.tie = bool(config.get("tie_word_embeddings", True))
        self.lm_head = (
            None
            if self.tie
            else ParallelLinear(embed_dim, [shape.vocab_size], gather_output=True, **kw)
        )

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + POSITION_OFFSET)
        residual = None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, kv, meta)
        if self.final_layer_norm is not None:
            x = (
                self.final_layer_norm(x)
                if residual is None
                else self.final_layer_norm(x, residual)[0]
            )
        elif residual is not None:
            x = residual + x
        if self.project_out is not None:
            x = self.project_out(x)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return gemv.linear(hidden, self.embed_tokens.weight)
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face names (``model.decoder.*``, or metaseq-era ``decoder.*``),
        fusing q/k/v into one matrix."""

        def rename(name: str) -> str | None:
            name = name.removeprefix("model.").removeprefix("decoder.")
            if self.tie and name == "lm_head.weight":
                return None
            return name

        load_checkpoint(self, weights, rename, _FUSED)
