"""Architecture name -> model class, and building a model from a local directory."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from streamkv.config import QUANTIZATIONS
from streamkv.layers import fp8
from streamkv.layers.linear import ParallelLinear
from streamkv.models.common import ModelShape
from streamkv.models.gguf import is_gguf_conversion
from streamkv.models.llama import LlamaForCausalLM
from streamkv.models.loader import is_preset, iter_safetensors, load_config
from streamkv.models.opt import OPTForCausalLM

logger = logging.getLogger(__name__)

ARCHITECTURES: dict[str, type[torch.nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
}

DUMMY_STD = 0.02


def model_class(config: dict) -> type[torch.nn.Module]:
    for arch in config.get("architectures") or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ValueError(
        f"unsupported architecture {config.get('architectures')!r}; "
        f"streamkv supports {sorted(ARCHITECTURES)}"
    )


def effective_load_format(model_dir: Path, load_format: str) -> str:
    """Resolve "auto" and refuse a format that does not fit the directory."""
    if is_preset(model_dir):
        if load_format not in ("auto", "dummy"):
            raise ValueError(
                f"{model_dir.name} is a built-in shape preset without weights: it only supports "
                f"load_format='dummy', not {load_format!r}"
            )
        return "dummy"
    if load_format == "gguf" and not is_gguf_conversion(model_dir):
        raise ValueError(
            f"load_format='gguf' needs a .gguf file, but {model_dir} is a Hugging Face directory"
        )
    if load_format == "safetensors" and is_gguf_conversion(model_dir):
        raise ValueError("load_format='safetensors' was asked for, but the model is a .gguf file")
    return "dummy" if load_format == "dummy" else "safetensors"


def init_dummy(model: torch.nn.Module, device: torch.device, seed: int) -> None:
    """Random N(0, 0.02) weights and biases drawn on the device, in the model's dtype; norms
    keep their constructed ones/zeros so activations stay finite in fp16.

    Each logical weight is drawn whole and the rank keeps its shard, so one seed gives the
    same model at every tensor-parallel size (TP=2 and TP=1 outputs can be compared)."""
    if torch.device(device).type == "meta":
        return
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(*shape: int, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(shape, dtype=like.dtype, device=like.device).normal_(
            0.0, DUMMY_STD, generator=gen
        )

    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            module.weight.data.normal_(0.0, DUMMY_STD, generator=gen)
        elif isinstance(module, ParallelLinear):
            w = module.weight
            in_full = w.shape[1] * (module.tp_size if module.parallel == "row" else 1)
            for part, size in enumerate(module.out_splits):
                module.load_part(part, draw(size, in_full, like=w))
                if module.has_bias:
                    # Drawn on every rank (even one without a row-parallel bias) so that
                    # all ranks' generators stay in step.
                    module.load_part(part, draw(size, like=w), is_bias=True)


def build_model(
    model_dir: Path | str,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    tp_rank: int = 0,
    tp_size: int = 1,
    seed: int = 0,
    config: dict | None = None,
    quantization: str | None = None,
) -> torch.nn.Module:
    """``config``: the model's config.json as already read (ModelInfo.hf_config), so a worker
    does not read it again; None reads it here (tools and tests). ``quantization="fp8"``
    converts the decoder layers' weights once they are loaded (quantize_layers)."""
    model_dir = Path(model_dir)
    config = load_config(model_dir) if config is None else config
    cls = model_class(config)
    shape = ModelShape.from_config(config)
    load_format = effective_load_format(model_dir, load_format)
    if quantization is not None:
        check_quantization(quantization, dtype, device)
    start = time.perf_counter()
    # Parameters are allocated directly on the device (torch.empty, no default init).
    with torch.device(device):
        model = cls(config, shape, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype, device=device)
    if load_format == "dummy":
        init_dummy(model, device, seed)
    else:
        model.load_weights(iter_safetensors(model_dir))
    if quantization == "fp8":
        quantize_layers(model)
    model.eval()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)  # so the load time below includes the async init
    n = num_parameters(model)
    logger.info(
        "loaded %s (%s weights): %.1fM parameters, %s%s, %.2f GiB in %.1fs",
        cls.__name__,
        load_format,
        n / 1e6,
        dtype,
        " (decoder layers fp8)" if quantization == "fp8" else "",
        parameter_bytes(model) / 2**30,
        time.perf_counter() - start,
    )
    return model


def check_quantization(quantization: str, dtype: torch.dtype, device: torch.device) -> None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}"
        )
    device = torch.device(device)
    if device.type != "cuda":
        return
    if dtype != fp8.CUDA_OUT_DTYPE:
        # torch._scaled_mm's row-wise scaling writes bf16 only; casting its output would
        # quietly give an fp16 or fp32 model less precision than it asked for.
        raise ValueError(f"quantization='fp8' on CUDA needs dtype bfloat16, got {dtype}")
    if torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(
            "quantization='fp8' needs fp8 tensor cores (compute capability 8.9+, e.g. L4, "
            f"H100, H200); {torch.cuda.get_device_name(device)} has "
            f"{torch.cuda.get_device_capability(device)}"
        )


def quantize_layers(model: torch.nn.Module) -> None:
    """FP8 weights for every linear layer inside the decoder layers (attention and MLP
    projections). The embedding and the lm_head stay in the model's dtype: they are a small
    share of a large model's weights, and the logits the sampler ranks come straight from
    the lm_head (vLLM's fp8 keeps it unquantized too)."""
    for layer in model.layers:
        for module in layer.modules():
            if isinstance(module, ParallelLinear):
                module.quantize_fp8()


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
