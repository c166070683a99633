"""One tensor-parallel rank for test_models_tensor_parallel.py. A separate module that does
not import transformers, so the spawned ranks start quickly."""

from __future__ import annotations

import os

import torch

from streamkv.layers.attention import AttentionMetadata
from streamkv.models.registry import build_model

WORLD = 2
IDS = [5, 17, 99, 3, 250, 41, 7, 600, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]


def prefill_logits(model, ids: list[int], block_size: int = 16) -> torch.Tensor:
    s, t = model.shape, len(ids)
    blocks = -(-t // block_size)
    kv_heads = model.layers[0].self_attn.attn.num_kv_heads
    caches = [
        (
            torch.zeros(blocks, kv_heads, block_size, s.head_dim),
            torch.zeros(blocks, kv_heads, block_size, s.head_dim),
        )
        for _ in range(s.num_layers)
    ]
    meta = AttentionMetadata.for_prompt(t, list(range(blocks)), block_size)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(t), caches, meta))


def run_rank(rank: int, root: str, names: list[str]) -> None:
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=WORLD
    )
    try:
        for name in names:
            model = build_model(
                f"{root}/{name}", torch.float32, torch.device("cpu"), tp_rank=rank, tp_size=WORLD
            )
            torch.save(prefill_logits(model, IDS), f"{root}/{name}.rank{rank}.pt")
    finally:
        dist.destroy_process_group()
