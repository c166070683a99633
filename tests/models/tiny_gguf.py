"""Writes a tiny Llama GGUF file (random float32 tensors, a toy gpt2-style vocabulary)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 1000, 64, 128, 2, 4, 2


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    from gguf import GGUFWriter

    head_dim = HIDDEN // HEADS
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_token_types([1] * VOCAB)
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(seed)

    def tensor(name: str, *shape: int, base: float = 0.0) -> None:
        w.add_tensor(name, (base + rng.standard_normal(shape) * 0.15).astype(np.float32))

    tensor("token_embd.weight", VOCAB, HIDDEN)
    for i in range(LAYERS):
        tensor(f"blk.{i}.attn_q.weight", HEADS * head_dim, HIDDEN)
        tensor(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        tensor(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        tensor(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * head_dim)
        tensor(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
        tensor(f"blk.{i}.attn_norm.weight", HIDDEN, base=1.0)
        tensor(f"blk.{i}.ffn_norm.weight", HIDDEN, base=1.0)
    tensor("output_norm.weight", HIDDEN, base=1.0)
    tensor("output.weight", VOCAB, HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
