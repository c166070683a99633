"""The ``streamkv`` command: ``generate`` (stream one completion to the terminal) and
``serve`` (the HTTP/WebSocket server)."""

from __future__ import annotations

import argparse
import logging
import sys

# The engine's flags are derived from the config dataclasses (one source, entrypoints/args.py).
from streamkv.entrypoints.args import add_engine_args, engine_kwargs

__all__ = ["add_engine_args", "build_parser", "engine_kwargs", "main"]


def cmd_generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from streamkv import SamplingParams
    from streamkv.entrypoints.llm import LLM

    try:
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            max_tokens=args.max_tokens, seed=args.seed, stop=args.stop or None,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with tqdm(total=1, desc="loading model", file=sys.stderr, leave=False) as bar:
        llm = LLM(args.model, **engine_kwargs(args))
        bar.update(1)
    try:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamkv", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream one completion to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="local HF directory or .gguf (default: embedded SmolLM2)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    from streamkv.entrypoints.server import add_serve_parser

    add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
