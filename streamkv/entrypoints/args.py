"""Engine arguments from one source: the config dataclasses' fields (streamkv/config.py).

``add_engine_args`` derives the ``streamkv serve`` / ``generate`` flags (name, type, default,
choices, help) from the fields of ModelConfig, CacheConfig and SchedulerConfig;
``engine_kwargs`` reads them back from the parsed namespace; ``engine_config`` builds an
EngineConfig from keyword arguments (what ``LLM(**kwargs)`` takes), refusing unknown ones.
A new config field is therefore a new flag and a new ``LLM`` keyword, with nothing to keep
in step by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from streamkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

# EngineConfig's part -> its dataclass, in the order the flags are listed.
SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
}


def engine_fields() -> dict[str, tuple[str, dataclasses.Field, Any]]:
    """Every engine argument: name -> (section, field, its type with None removed)."""
    out: dict[str, tuple[str, dataclasses.Field, Any]] = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.metadata.get("cli", True):
                continue  # the model (each command's own argument) or a derived value
            if f.name in out:
                raise TypeError(
                    f"engine argument {f.name!r} is defined twice ({out[f.name][0]}, {section})"
                )
            out[f.name] = (section, f, _base_type(hints[f.name]))
    return out


def _base_type(hint: Any) -> Any:
    """``int | None`` -> int; a plain type stays itself."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return hint


# Each section's group in ``--help`` (vLLM groups its flags by config class the same way).
GROUP_TITLES = {
    "model": "model config",
    "cache": "cache config (KV blocks, swap, prefix cache)",
    "scheduler": "scheduler config (batching, preemption)",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    groups = {section: parser.add_argument_group(GROUP_TITLES[section]) for section in SECTIONS}
    for name, (section, f, kind) in engine_fields().items():
        flags = [f"--{name.replace('_', '-')}", *f.metadata.get("flag", ())]
        kwargs: dict[str, Any] = {
            "default": f.default,
            "help": f.metadata.get("help"),
            "dest": name,
        }
        if "metavar" in f.metadata:
            kwargs["metavar"] = f.metadata["metavar"]
        if f.metadata.get("repeatable"):
            # argparse appends to the default itself: start from None, engine_kwargs gives
            # the field's default back when the flag is absent.
            kwargs.update(action="append", default=None, type=str)
        elif kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = kind
            if "choices" in f.metadata:
                kwargs["choices"] = list(f.metadata["choices"])
        groups[section].add_argument(*flags, **kwargs)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments of a namespace parsed with ``add_engine_args``."""
    out = {}
    for name, (_, f, _) in engine_fields().items():
        value = getattr(args, name)
        if f.metadata.get("repeatable"):
            value = f.default if value is None else tuple(value)
        out[name] = value
    return out


def engine_config(model: str | None = None, **kwargs: Any) -> EngineConfig:
    """An EngineConfig from keyword engine arguments (the names of the config fields)."""
    fields = engine_fields()
    unknown = sorted(set(kwargs) - set(fields))
    if unknown:
        raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(fields)}")
    parts: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    parts["model"]["model"] = model
    for name, value in kwargs.items():
        parts[fields[name][0]][name] = value
    return EngineConfig(**{section: cls(**parts[section]) for section, cls in SECTIONS.items()})
