"""What the ``streamkv`` commands share (main.py builds the parser, serve.py the
``serve`` command): the help format, the common flags, the server's limit flags and the
chat-template loader. A module of its own so that neither command module imports the other."""

from __future__ import annotations

import argparse
from pathlib import Path

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


# -- serve: connection, security and shutdown flags ---------------------------------------
# Kept apart from the engine flags above (those come from the config dataclasses); these
# configure only the HTTP server (entrypoints/server/connections.py, security.py, shutdown.py).
def add_server_limit_args(g) -> None:
    g.add_argument(
        "--allowed-hosts",
        action="append",
        default=[],
        help="host names this server answers to besides loopback names and --host (comma list, "
        "repeatable; '.example.com' matches subdomains; '*' = any). Other Host headers get "
        "421: a DNS-rebinding page cannot reach the API",
    )
    # Above --max-queue-len + max_num_seqs, so that a burst meets the queue's 429 (with
    # Retry-After) before the connection cap: a benchmark client opens one connection per
    # request, and vLLM's and SGLang's default call sends 1,000 at once.
    g.add_argument(
        "--limit-concurrency",
        type=int,
        default=10240,
        help="open connections (HTTP and WebSocket); beyond it a request gets a JSON 503 (the "
        "process's open-file limit is raised to fit it, or the cap lowered to fit that)",
    )
    g.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=5.0,
        help="seconds an idle keep-alive connection stays open",
    )
    g.add_argument(
        "--timeout-request-head",
        type=float,
        default=10.0,
        help="seconds from connecting (or a request's first byte) to the end of its head; "
        "then 408 and the connection closes",
    )
    g.add_argument(
        "--timeout-request-body",
        type=float,
        default=30.0,
        help="seconds from a request's head to the end of its body; then 408 and close",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds running requests may take to finish before they "
        "are ended with an error",
    )
    g.add_argument(
        "--max-worker-restarts",
        type=int,
        default=3,
        help="worker processes that die or freeze are restarted and their requests resume; "
        "after this many restarts within 5 minutes the server exits with status 1",
    )


def check_server_limit_args(args: argparse.Namespace) -> None:
    if args.limit_concurrency < 1:
        raise SystemExit("--limit-concurrency must be >= 1")
    for name in ("timeout_keep_alive", "timeout_request_head", "timeout_request_body"):
        if not getattr(args, name) > 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be > 0")
    if args.shutdown_timeout < 0:
        raise SystemExit("--shutdown-timeout must be >= 0")
    if args.max_worker_restarts < 0:
        raise SystemExit("--max-worker-restarts must be >= 0")


# -- end of serve flags --------------------------------------------------------------------


def load_chat_template(value: str) -> str:
    """``--chat-template``: a file's text, or the value itself when it is an inline Jinja
    template; checked for syntax here so that a typo fails at start, not per request."""
    path = Path(value).expanduser()
    if path.is_file():
        text = path.read_text()
    elif any(c in value for c in "{}\n"):
        text = value
    else:
        raise ValueError(
            f"--chat-template {value!r} is neither a file nor an inline Jinja template"
        )
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: line {e.lineno}: {e.message}") from None
    return text


def set_chat_template(tokenizer, template: str) -> None:
    if tokenizer is None:
        raise ValueError("--chat-template needs a tokenizer, and this model has none")
    tokenizer.chat_template = template  # what apply_chat_template uses when given none


class HelpFormatter(argparse.HelpFormatter):
    """Every flag's default in ``--help`` (argparse's ArgumentDefaultsHelpFormatter would
    also print ``(default: None)`` for flags whose help says what None means)."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=36, width=min(110, _terminal_width()))

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        default = action.default
        if "%(default)" in help or "default:" in help or not action.option_strings:
            return help
        if (
            default is None
            or default is argparse.SUPPRESS
            or default in ([], "")
            or default is False
        ):
            return help
        return f"{help} (default: %(default)s)" if help else "(default: %(default)s)"


def _terminal_width() -> int:
    import shutil

    return shutil.get_terminal_size((100, 24)).columns


def add_common_args(p: argparse.ArgumentParser) -> None:
    """Flags every command takes, after its name too (``streamkv serve --log-level DEBUG``)."""
    from streamkv import __version__

    g = p.add_argument_group("common")
    g.add_argument("--version", action="version", version=f"streamkv {__version__}")
    g.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=argparse.SUPPRESS,
        help="log level (default: INFO; also accepted before the command)",
    )
    g.add_argument(
        "--config",
        metavar="FILE.yaml",
        default=None,
        help="read flags from a YAML mapping of flag names to values (e.g. 'port: 8001', "
        "'max-model-len: 4096'); flags on the command line win",
    )
