"""Architecture name -> model class, and building a model from a local directory."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from streamkv.models.common import ModelShape
from streamkv.models.llama import LlamaForCausalLM
from streamkv.models.loader import iter_safetensors, load_config

logger = logging.getLogger(__name__)

ARCHITECTURES: dict[str, type[torch.nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def model_class(config: dict) -> type[torch.nn.Module]:
    for arch in config.get("architectures") or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ValueError(
        f"unsupported architecture {config.get('architectures')!r}; "
        f"streamkv supports {sorted(ARCHITECTURES)}"
    )


def build_model(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    tp_rank: int = 0,
    tp_size: int = 1,
    seed: int = 0,
) -> torch.nn.Module:
    config = load_config(model_dir)
    cls = model_class(config)
    shape = ModelShape.from_config(config)
    start = time.perf_counter()
    with torch.device(device):
        model = cls(config, shape, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype, device=device)
    if load_format == "dummy":
        gen = torch.Generator(device=device).manual_seed(seed)
        for p in model.parameters():
            p.data.normal_(0.0, 0.02, generator=gen)
    else:
        model.load_weights(iter_safetensors(model_dir))
    model.eval()
    n = sum(p.numel() for p in model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    logger.info(
        "loaded %s: %.1fM parameters, %s, %.2f GiB in %.1fs",
        cls.__name__, n / 1e6, dtype, nbytes / 2**30, time.perf_counter() - start,
    )
    return model
