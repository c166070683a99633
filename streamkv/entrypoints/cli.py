"""The ``streamkv`` command: ``generate`` (stream one completion to the terminal) and
``serve`` (the HTTP/WebSocket server)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from streamkv import __version__

# The engine's flags are derived from the config dataclasses (one source, entrypoints/args.py).
from streamkv.entrypoints.args import add_engine_args, engine_kwargs
from streamkv.entrypoints.config_file import (
    ConfigFileError,
    command_index,
    config_tokens,
    read_config_file,
)

__all__ = ["add_engine_args", "build_parser", "engine_kwargs", "main"]
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def cmd_generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from streamkv import SamplingParams
    from streamkv.entrypoints.llm import LLM

    try:
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            max_tokens=args.max_tokens, seed=args.seed, stop=args.stop or None,
        )
        template = load_chat_template(args.chat_template) if args.chat_template else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with tqdm(total=1, desc="loading model", file=sys.stderr, leave=False) as bar:
        llm = LLM(args.model, **engine_kwargs(args))
        bar.update(1)
    try:
        if template is not None:
            set_chat_template(llm.get_tokenizer(), template)
        return _stream(llm, args, params)
    finally:
        llm.shutdown()


def _stream(llm, args: argparse.Namespace, params) -> int:
    engine = llm.engine
    prompt = args.prompt
    if args.chat:
        tok = llm.get_tokenizer()
        prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        ids = tok.encode(prompt, add_special_tokens=False)
    else:
        ids = None
    engine.add_request("cli", prompt, params, prompt_token_ids=ids)
    printed = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text if out.outputs else ""
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
            if out.finished and out.error:
                print(f"\nerror: {out.error}", file=sys.stderr)
                return 1
    sys.stdout.write("\n")
    return 0


# -- serve: connection, security and shutdown flags ---------------------------------------
# Kept apart from the engine flags above (those come from the config dataclasses); these
# configure only the HTTP server (entrypoints/connections.py, security.py, shutdown.py).
def add_server_limit_args(g) -> None:
    g.add_argument("--allowed-hosts", action="append", default=[],
                   help="host names this server answers to besides loopback names and --host (comma list, "
                        "repeatable; '.example.com' matches subdomains; '*' = any). Other Host headers get "
                        "421: a DNS-rebinding page cannot reach the API")
    g.add_argument("--limit-concurrency", type=int, default=512,
                   help="open connections (HTTP and WebSocket); beyond it a request gets a JSON 503")
    g.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open")
    g.add_argument("--timeout-request-head", type=float, default=10.0,
                   help="seconds from connecting (or a request's first byte) to the end of its head; "
                        "then 408 and the connection closes")
    g.add_argument("--timeout-request-body", type=float, default=30.0,
                   help="seconds from a request's head to the end of its body; then 408 and close")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds running requests may take to finish before they "
                        "are ended with an error")
    g.add_argument("--max-worker-restarts", type=int, default=3,
                   help="worker processes that die or freeze are restarted and their requests resume; "
                        "after this many restarts within 5 minutes the server exits with status 1")


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
        raise ValueError(f"--chat-template {value!r} is neither a file nor an inline Jinja template")
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
        if default is None or default is argparse.SUPPRESS or default in ([], "") or default is False:
            return help
        return f"{help} (default: %(default)s)" if help else "(default: %(default)s)"


def _terminal_width() -> int:
    import shutil

    return shutil.get_terminal_size((100, 24)).columns


def add_common_args(p: argparse.ArgumentParser) -> None:
    """Flags every command takes, after its name too (``streamkv serve --log-level DEBUG``)."""
    g = p.add_argument_group("common")
    g.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=argparse.SUPPRESS,
                   help="log level (default: INFO; also accepted before the command)")
    g.add_argument("--config", metavar="FILE.yaml", default=None,
                   help="read flags from a YAML mapping of flag names to values (e.g. 'port: 8001', "
                        "'max-model-len: 4096'); flags on the command line win")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamkv", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default="INFO")
    parser.add_argument("--version", action="version", version=f"streamkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate,worker}")

    gen = sub.add_parser("generate", help="stream one completion to the terminal", formatter_class=HelpFormatter,
                         allow_abbrev=False, description="Stream one completion of PROMPT to the terminal.")
    gen.add_argument("prompt")
    g = gen.add_argument_group("generation")
    g.add_argument("--model", default=None, help="local HF directory, .gguf file or shape preset "
                                                 "(default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="Jinja chat template (a file or the template itself) instead of the tokenizer's")
    add_common_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    from streamkv.entrypoints.serve_cli import add_serve_parser
    from streamkv.executor.launcher import add_worker_parser  # ranks on another host (issue 17)

    parser.commands = {"generate": gen, "serve": add_serve_parser(sub), "worker": add_worker_parser(sub)}
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; with ``--config FILE`` the file's flags go in first, so the command
    line's own win."""
    args = parser.parse_args(argv)
    if not getattr(args, "config", None):
        return args
    at = command_index(argv, set(parser.commands))
    command = parser.commands[argv[at]]
    try:
        tokens, model = config_tokens(read_config_file(args.config), command, argv[at + 1:], args.config)
    except ConfigFileError as e:
        command.error(str(e))
    args = parser.parse_args([*argv[:at + 1], *tokens, *argv[at + 1:]])
    if model is not None and getattr(args, "model", None) is None:
        args.model = str(model)
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, sys.argv[1:] if argv is None else list(argv))
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
