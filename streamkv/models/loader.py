"""Where weights come from: the embedded default GGUF or any .gguf file (converted once, by
models/gguf.py), a local Hugging Face directory, or random ("dummy") weights of a config's
shape — including the built-in shape presets (``presets/<name>/config.json``: real public
configs, no weights, no tokenizer).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from streamkv.model_info import ModelInfo

if TYPE_CHECKING:
    from streamkv.config import ModelConfig

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PRESETS_DIR = Path(__file__).parent / "presets"


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


def resolve_model_dir(model: str | None) -> Path:
    """The local Hugging Face directory to load for ``model`` (None = embedded default)."""
    from streamkv.models.gguf import convert_gguf, embedded_gguf_path  # it imports phase

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
