"""``--config FILE.yaml``: a YAML mapping of flag names to values, as vLLM reads one.

Keys are the flag names without dashes (``max-model-len`` or ``max_model_len``); ``model``
is the positional MODEL of ``serve``. Values become the flags they name, placed before the
command line's own, so that a flag given on the command line wins (for a repeatable flag
the command line's values replace the file's). An unknown key is an error that names it.
"""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path
from typing import Any


class ConfigFileError(ValueError):
    pass


def read_config_file(path: str) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(Path(path).expanduser().read_text())
    except OSError as e:
        raise ConfigFileError(f"--config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigFileError(f"--config {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(
            f"--config {path} must be a mapping of flag names to values, "
            f"got a {type(data).__name__}"
        )
    return data


def config_tokens(
    data: dict[str, Any],
    parser: argparse.ArgumentParser,
    cli: list[str],
    path: str = "the config file",
) -> tuple[list[str], Any]:
    """The command-line tokens the file stands for (minus flags ``cli`` gives itself) and
    the file's positional ``model`` (None if it has none)."""
    actions = {opt: a for a in parser._actions for opt in a.option_strings}
    positional = {a.dest for a in parser._actions if not a.option_strings}
    tokens: list[str] = []
    model = None
    for key, value in data.items():
        name = str(key).replace("_", "-")
        if name == "model" and "model" in positional:
            model = value
            continue
        flag = f"--{name}"
        action = actions.get(flag)
        if action is None or flag in ("--config", "--help", "--version"):
            known = sorted(
                o[2:] for o in actions if o.startswith("--") and o not in ("--config", "--help")
            )
            close = difflib.get_close_matches(name, known, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigFileError(f"{path}: unknown key {key!r}{hint}")
        if any(t == o or t.startswith(o + "=") for t in cli for o in action.option_strings):
            continue  # the command line says it itself
        tokens += _tokens(flag, action, value, key, path)
    return tokens, model


def _tokens(flag: str, action: argparse.Action, value: Any, key: str, path: str) -> list[str]:
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        if not isinstance(value, bool):
            raise ConfigFileError(f"{path}: {key!r} takes true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if value else f"--no-{flag[2:]}"]
        return [flag] if value else []
    if value is None:
        return []  # the flag's own default
    repeatable = isinstance(action.default, list) or type(action).__name__ == "_AppendAction"
    if action.nargs in ("+", "*"):  # several values after one flag (served-model-name: [a, b])
        return [flag, *map(str, value if isinstance(value, list) else [value])]
    if isinstance(value, list):
        if not repeatable:
            raise ConfigFileError(f"{path}: {key!r} takes one value, got a list")
        return [t for item in value for t in (flag, str(item))]
    return [flag, str(value)]


def command_index(argv: list[str], commands: set[str]) -> int:
    """Where the subcommand stands in ``argv`` (after the top-level options)."""
    i = 0
    while i < len(argv):
        token = argv[i]
        if token in commands:
            return i
        i += 2 if token == "--log-level" else 1
    return -1
