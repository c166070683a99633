"""The ``streamkv`` command: ``serve`` (the HTTP/WebSocket server), ``chat`` (talk to a
running server from the terminal) and ``generate`` (stream one completion offline)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from streamkv import __version__

# The engine's flags are derived from the config dataclasses (one source, entrypoints/args.py).
from streamkv.entrypoints.args import add_engine_args, engine_kwargs
from streamkv.entrypoints.cli.common import (
    LOG_LEVELS,
    HelpFormatter,
    add_common_args,
    load_chat_template,
    set_chat_template,
)
from streamkv.entrypoints.cli.config_file import (
    ConfigFileError,
    command_index,
    config_tokens,
    read_config_file,
)

__all__ = ["build_parser", "main", "parse_args"]


def cmd_generate(args: argparse.Namespace) -> int:
    from streamkv import SamplingParams
    from streamkv.entrypoints.llm import LLM
    from streamkv.models.loader import phase

    if args.model_flag is not None:
        if args.model is not None:
            return _fail(
                f"the model is given twice ({args.model!r} and --model {args.model_flag!r})"
            )
        args.model = args.model_flag
    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_tokens=args.max_tokens,
            seed=args.seed,
            stop=args.stop or None,
        )
        template = load_chat_template(args.chat_template) if args.chat_template else None
        with phase("loading the model and allocating the KV cache"):
            llm = LLM(args.model, **engine_kwargs(args))
    except (ValueError, OSError, RuntimeError) as e:  # a user's mistake: one line, no traceback
        return _fail(e)
    try:
        if template is not None:
            set_chat_template(llm.get_tokenizer(), template)
        return _stream(llm, args, params)
    except (ValueError, RuntimeError) as e:
        return _fail(e)
    finally:
        llm.shutdown()


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from streamkv.bench.serve import main as bench_serve

    return bench_serve(args.rest)


def _fail(e: object) -> int:
    text = str(e).strip().splitlines()
    print(f"error: {text[0] if text else type(e).__name__}", file=sys.stderr)
    return 2


def _stream(llm, args: argparse.Namespace, params) -> int:
    engine = llm.engine
    prompt = args.prompt
    if args.chat:
        tok = llm.get_tokenizer()
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        ids = tok.encode(prompt, add_special_tokens=False)
    else:
        ids = None
    engine.add_request("cli", prompt, params, prompt_token_ids=ids)
    printed, t0, first, tokens = 0, time.perf_counter(), None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.error:
                print(f"\nerror: {out.error}", file=sys.stderr)
                return 1
            text = out.outputs[0].text if out.outputs else ""
            tokens = len(out.outputs[0].token_ids) if out.outputs else tokens
            if tokens and first is None:
                first = time.perf_counter()
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
    took = time.perf_counter() - t0
    sys.stdout.write("\n")
    rate = (
        f"{(tokens - 1) / (took - (first - t0)):.1f} tok/s"
        if first is not None and tokens > 1 and took > first - t0
        else "-"
    )
    print(
        f"[{tokens} tokens in {took:.2f} s · {rate} after "
        f"the first, which came at {(first or t0) - t0:.2f} s]",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamkv", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default="INFO")
    parser.add_argument("--version", action="version", version=f"streamkv {__version__}")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{serve,chat,generate,bench,worker}"
    )
    gen = _add_generate_parser(sub)

    from streamkv.entrypoints.cli.chat import add_chat_parser
    from streamkv.entrypoints.cli.serve import add_serve_parser
    from streamkv.executor.launcher import add_worker_parser  # ranks on another host (issue 17)

    bench = _add_bench_parser(sub)
    parser.commands = {
        "generate": gen,
        "serve": add_serve_parser(sub),
        "chat": add_chat_parser(sub),
        "bench": bench,
        "worker": add_worker_parser(sub),
    }
    return parser


def _add_generate_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    gen = sub.add_parser(
        "generate",
        help="stream one completion to the terminal (offline, no server)",
        formatter_class=HelpFormatter,
        allow_abbrev=False,
        description="Stream one completion of PROMPT to the terminal, then its tokens/s. "
        "MODEL as for `streamkv serve`.",
    )
    gen.add_argument(
        "model",
        nargs="?",
        default=None,
        help="local HF directory, .gguf file or shape preset (default: the embedded "
        "SmolLM2-135M-Instruct)",
    )
    gen.add_argument("prompt")
    g = gen.add_argument_group("generation")
    g.add_argument(
        "--model", dest="model_flag", default=None, help=argparse.SUPPRESS
    )  # the older spelling
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="Jinja chat template (a file or the template itself) instead of the tokenizer's",
    )
    add_common_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    return gen


def _add_bench_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    bench = sub.add_parser(
        "bench", help="benchmarks: `streamkv bench serve --help`", formatter_class=HelpFormatter
    )
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="{serve}")
    # Its own parser reads the rest (streamkv/bench/serve.py), --help included.
    serve_bench = kinds.add_parser(
        "serve",
        add_help=False,
        prefix_chars="\0",
        help="vLLM benchmark_serving's call against `streamkv serve`, beside the offline engine",
    )
    serve_bench.add_argument("rest", nargs=argparse.REMAINDER)
    serve_bench.set_defaults(func=cmd_bench_serve)
    return bench


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; with ``--config FILE`` the file's flags go in first, so the command
    line's own win."""
    args = parser.parse_args(argv)
    if not getattr(args, "config", None):
        return args
    at = command_index(argv, set(parser.commands))
    command = parser.commands[argv[at]]
    try:
        # A flag given before the command (--log-level) is the command line's too: it wins.
        tokens, model = config_tokens(
            read_config_file(args.config), command, argv[:at] + argv[at + 1 :], args.config
        )
    except ConfigFileError as e:
        command.error(str(e))
    args = parser.parse_args([*argv[: at + 1], *tokens, *argv[at + 1 :]])
    if model is not None and getattr(args, "model", None) is None:
        args.model = str(model)
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, sys.argv[1:] if argv is None else list(argv))
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return args.func(args) or 0
