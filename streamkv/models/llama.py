"""Llama-family decoder (Llama 2/3, Mistral, SmolLM2; Qwen2 through ``attention_bias``) on
block tables: RoPE, RMSNorm, SwiGLU, grouped-query attention, optional tied embeddings.
Attention heads and the MLP are split column/row-wise for tensor parallelism."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from streamkv.layers.attention import AttentionMetadata, PagedAttention
from streamkv.layers.linear import ParallelLinear
from streamkv.layers.norm import RMSNorm
from streamkv.layers.rotary import RotaryEmbedding
from streamkv.models.common import ModelShape, rope_settings


class LlamaAttention(nn.Module):
    def __init__(self, s: ModelShape, bias: bool, **kw) -> None:
        super().__init__()
        tp = kw["tp_size"]
        self.num_heads = s.num_heads // tp
        self.num_kv_heads = max(1, s.num_kv_heads // tp)
        self.head_dim = s.head_dim
        self.qkv_proj = ParallelLinear(
            s.hidden_size,
            [s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim],
            bias=bias,
            **kw,
        )
        self.o_proj = ParallelLinear(s.num_heads * s.head_dim, [s.hidden_size], parallel="row", **kw)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, s.head_dim, s.head_dim**-0.5)

    def forward(self, positions, x, kv_cache, meta: AttentionMetadata, rotary: RotaryEmbedding):
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        out = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(out.view(t, q_size))


class LlamaMLP(nn.Module):
    def __init__(self, s: ModelShape, **kw) -> None:
        super().__init__()
        self.gate_up_proj = ParallelLinear(s.hidden_size, [s.intermediate_size] * 2, **kw)
        self.down_proj = ParallelLinear(s.intermediate_size, [s.hidden_size], parallel="row", **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, s: ModelShape, bias: bool, **kw) -> None:
        super().__init__()
        dd = {"dtype": kw["dtype"], "device": kw["device"]}
        self.input_layernorm = RMSNorm(s.hidden_size, s.norm_eps, **dd)
        self.self_attn = LlamaAttention(s, bias, **kw)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.norm_eps, **dd)
        self.mlp = LlamaMLP(s, **kw)

    def forward(self, positions, x, kv_cache, meta, rotary):
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, meta, rotary)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: dict, shape: ModelShape, tp_rank=0, tp_size=1, dtype=torch.float32, device="cpu"):
        super().__init__()
        kw = {"tp_rank": tp_rank, "tp_size": tp_size, "dtype": dtype, "device": device}
        self.config, self.shape, self.tp_size = config, shape, tp_size
        bias = bool(config.get("attention_bias", False)) or config.get("model_type") == "qwen2"
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(shape, bias, **kw) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.norm_eps, dtype=dtype, device=device)
        self.tie = bool(config.get("tie_word_embeddings", False))
        self.lm_head = None if self.tie else ParallelLinear(shape.hidden_size, [shape.vocab_size], **kw)
        theta, scaling = rope_settings(config)
        self.rotary = RotaryEmbedding(shape.head_dim, shape.max_positions, theta, scaling, device=device)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(positions, x, kv, meta, self.rotary)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight)
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face names, fusing q/k/v and gate/up into one matrix each."""
        pending: dict[str, torch.Tensor] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            pending[name] = tensor
        params = dict(self.named_parameters())
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            attn = p + "self_attn."
            qkv = [pending.pop(attn + f"{n}_proj.weight") for n in "qkv"]
            qkv_b = [pending.pop(attn + f"{n}_proj.bias") for n in "qkv"] if layer.self_attn.qkv_proj.bias is not None else None
            layer.self_attn.qkv_proj.load(qkv, qkv_b)
            layer.self_attn.o_proj.load([pending.pop(attn + "o_proj.weight")])
            mlp = p + "mlp."
            layer.mlp.gate_up_proj.load([pending.pop(mlp + "gate_proj.weight"), pending.pop(mlp + "up_proj.weight")])
            layer.mlp.down_proj.load([pending.pop(mlp + "down_proj.weight")])
            loaded |= {n for n in params if n.startswith(p) and "layernorm" not in n}
        if self.lm_head is not None:
            self.lm_head.load([pending.pop("lm_head.weight")])
            loaded.add("lm_head.weight")
        else:
            pending.pop("lm_head.weight", None)
        if self.tp_size > 1:
            raise NotImplementedError("sharded embeddings for tensor parallelism")
        for name, tensor in pending.items():
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            params[name].data.copy_(tensor)
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"weights missing from checkpoint: {sorted(missing)[:8]}")
