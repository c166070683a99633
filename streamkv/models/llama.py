"""Llama-family decoder (Llama 2/3, Mistral, SmolLM2, Qwen2) on block tables: RoPE,
RMSNorm, SwiGLU, grouped-query attention, optional tied embeddings. Attention heads and the
MLP are split column/row-wise for tensor parallelism; embeddings are replicated.

Family differences, all read from config.json:
- Qwen2 has biases on q/k/v (not on o); Llama's ``attention_bias`` puts them on q/k/v/o,
  ``mlp_bias`` on the three MLP projections.
- Mistral's sliding window is handled by capping the context at the window
  (``common.limit_context_to_window``), where full attention is exact.
- Llama 3.1+ ``rope_scaling`` of type llama3 (and linear) lives in ``layers/rotary.py``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from streamkv.kernels import gemv
from streamkv.layers.attention import AttentionMetadata, PagedAttention
from streamkv.layers.linear import ParallelLinear
from streamkv.layers.norm import RMSNorm
from streamkv.layers.rotary import RotaryEmbedding
from streamkv.models.common import ModelShape, embedding, load_checkpoint, rope_settings

_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def tp_heads(num_heads: int, num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """Heads per rank; every rank must hold whole query and KV heads."""
    if num_heads % tp_size or num_kv_heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} must divide the {num_heads} attention heads "
            f"and the {num_kv_heads} KV heads"
        )
    return num_heads // tp_size, num_kv_heads // tp_size


class LlamaAttention(nn.Module):
    def __init__(self, s: ModelShape, qkv_bias: bool, o_bias: bool, **kw) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = tp_heads(s.num_heads, s.num_kv_heads, kw["tp_size"])
        self.head_dim = s.head_dim
        self.qkv_proj = ParallelLinear(
            s.hidden_size,
            [s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim],
            bias=qkv_bias,
            **kw,
        )
        self.o_proj = ParallelLinear(
            s.num_heads * s.head_dim, [s.hidden_size], bias=o_bias, parallel="row", **kw
        )
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, s.head_dim, s.head_dim**-0.5)

    def forward(self, positions, x, kv_cache, meta: AttentionMetadata, rotary: RotaryEmbedding):
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)  # in place, in the q/k/v projection's output
        out = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(out.view(t, q_size))


class LlamaMLP(nn.Module):
    def __init__(self, s: ModelShape, bias: bool, **kw) -> None:
        super().__init__()
        self.gate_up_proj = ParallelLinear(
            s.hidden_size, [s.intermediate_size] * 2, bias=bias, **kw
        )
        self.down_proj = ParallelLinear(
            s.intermediate_size, [s.hidden_size], bias=bias, parallel="row", **kw
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # SiLU-and-mul inside the gate/up product for a few tokens, its own kernel otherwise.
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, s: ModelShape, biases: tuple[bool, bool, bool], **kw) -> None:
        super().__init__()
        dd = {"dtype": kw["dtype"], "device": kw["device"]}
        qkv_bias, o_bias, mlp_bias = biases
        self.input_layernorm = RMSNorm(s.hidden_size, s.norm_eps, **dd)
        self.self_attn = LlamaAttention(s, qkv_bias, o_bias, **kw)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.norm_eps, **dd)
        self.mlp = LlamaMLP(s, mlp_bias, **kw)

    def forward(self, positions, x, residual, kv_cache, meta, rotary):
        """Returns (this layer's MLP output, the residual stream before it is added): the
        next norm adds the two, fused (vLLM's layout). The first layer gets residual None."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta, rotary)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
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
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(
                f"hidden_act {act!r} is not supported for {config.get('architectures')}; only silu"
            )
        kw = {"tp_rank": tp_rank, "tp_size": tp_size, "dtype": dtype, "device": device}
        self.config, self.shape, self.tp_size = config, shape, tp_size
        attention_bias = bool(config.get("attention_bias", False))
        qwen2 = config.get("model_type") == "qwen2"
        biases = (attention_bias or qwen2, attention_bias, bool(config.get("mlp_bias", False)))
        self.embed_tokens = embedding(shape.vocab_size, shape.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(shape, biases, **kw) for _ in range(shape.num_layers)
        )
        self.norm = RMSNorm(shape.hidden_size, shape.norm_eps, dtype=dtype, device=device)
        self.tie = bool(config.get("tie_word_embeddings", False))
        self.lm_head = (
            None
            if self.tie
            else ParallelLinear(shape.hidden_size, [shape.vocab_size], gather_output=True, **kw)
        )
        theta, scaling = rope_settings(config)
        self.rotary = RotaryEmbedding(
            shape.head_dim, shape.max_positions, theta, scaling, device=device
        )

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, kv, meta, self.rotary)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return gemv.linear(hidden, self.embed_tokens.weight)
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face names, fusing q/k/v and gate/up into one matrix each."""

        def rename(name: str) -> str | None:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (self.tie and name == "lm_head.weight"):
                return None
            return name

        load_checkpoint(self, weights, rename, _FUSED)
