"""``streamkv serve``'s flags, grouped as vLLM groups them; their checks; and the defaults
``serve`` resolves from them (the served model's name, the executor).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from streamkv.engine.serving_logs import DEFAULT_STATS_INTERVAL_S
from streamkv.engine.watchdog import STEP_TIMEOUT_S
from streamkv.entrypoints.args import add_engine_args
from streamkv.entrypoints.cli.common import (
    add_common_args,
    add_server_limit_args,
    check_server_limit_args,
)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Every flag of ``streamkv serve``, one group at a time; the order here is --help's."""
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="local HF directory, .gguf file or shape preset (default: the embedded "
        "SmolLM2-135M-Instruct)",
    )
    _add_server_args(p)
    _add_api_args(p)
    _add_logging_args(p)
    _add_security_args(p)
    add_common_args(p)
    add_engine_args(p)


def _add_server_args(p: argparse.ArgumentParser) -> None:
    """Where and how the server listens, and what it calls the model."""
    s = p.add_argument_group("server")
    s.add_argument(
        "--host", default="127.0.0.1", help="address to listen on ('0.0.0.0': every interface)"
    )
    s.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    s.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model id clients use (default: from MODEL); several: any may be asked for, "
        "the first is the one in the logs and metrics",
    )
    s.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="Jinja chat template (a file or the template itself) instead of the tokenizer's",
    )
    s.add_argument(
        "--root-path",
        default="",
        help="path prefix when behind a proxy that routes a path to this server (e.g. /llm)",
    )
    s.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key file")
    s.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate file")
    s.add_argument(
        "--loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="the event loop. asyncio by default: uvloop writes each SSE event holding the "
        "GIL that the engine thread needs, and served 7%% less under a burst on an H200 "
        '(docs/benchmarks.md "Serving")',
    )
    s.add_argument(
        "--api-key",
        default=os.environ.get("STREAMKV_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $STREAMKV_API_KEY; none = open)",
    )


def _add_api_args(p: argparse.ArgumentParser) -> None:
    """How the OpenAI API answers: tool calls, logprobs' token names, type coercion, errors."""
    tc = p.add_argument_group("tool calling")
    tc.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="tool_choice 'auto' parses the model's own tool calls into tool_calls (off: such a "
        "request is a 400, as in vLLM without this flag)",
    )
    tc.add_argument(
        "--tool-call-parser",
        choices=("hermes",),
        default="hermes",
        help="the model's tool-call format: Hermes-style <tool_call> JSON (SmolLM2's, Qwen2's)",
    )
    p.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help='logprobs name tokens "token_id:ID" unless a request says otherwise (vLLM\'s flag)',
    )
    p.add_argument(
        "--strict-request-types",
        action="store_true",
        help='refuse "5" for 5 and "true" for true in request bodies, as OpenAI does (default: '
        "coerce them, as vLLM does)",
    )
    p.add_argument(
        "--error-format",
        choices=("openai", "vllm"),
        default="openai",
        help="error bodies' type and code: OpenAI's strings (invalid_request_error, queue_full), "
        "or vLLM's error class name and integer status (BadRequestError, 400)",
    )
    p.add_argument(
        "--tools-system-prompt",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="for a chat template that ignores tools, list the offered tools in a system message "
        "(--no-tools-system-prompt: leave them out, as vLLM does)",
    )


def _add_logging_args(p: argparse.ArgumentParser) -> None:
    lg = p.add_argument_group("logging")
    lg.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic stats line (throughput, queues, KV usage, prefix-cache hit rate)",
    )
    lg.add_argument(
        "--log-stats-interval",
        type=float,
        default=DEFAULT_STATS_INTERVAL_S,
        help="seconds between stats lines",
    )
    lg.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="one INFO line per request: id, prompt length, sampling parameters (the prompt "
        "text only at --log-level DEBUG)",
    )
    lg.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="uvicorn's line per HTTP request",
    )


def _add_security_args(p: argparse.ArgumentParser) -> None:
    """Who may call, how much one request may ask, and when the server sheds load."""
    sec = p.add_argument_group("security and limits")
    sec.add_argument(
        "--allowed-origins",
        action="append",
        default=[],
        help="browser origins allowed besides the server's own (comma list, repeatable; '*' = any)",
    )
    sec.add_argument(
        "--max-request-body-bytes", type=int, default=2 * 2**20, help="larger bodies get 413"
    )
    sec.add_argument(
        "--max-header-bytes", type=int, default=16 * 1024, help="larger request heads are refused"
    )
    sec.add_argument(
        "--max-queue-len",
        type=int,
        default=4096,
        help="requests that may wait to start; beyond it 429 with Retry-After (-1: no limit)",
    )
    sec.add_argument(
        "--sse-keepalive", type=float, default=15.0, help="seconds between SSE keep-alive comments"
    )
    sec.add_argument(
        "--ws-max-active", type=int, default=8, help="concurrent generations per WebSocket"
    )
    sec.add_argument(
        "--engine-step-timeout",
        type=float,
        default=STEP_TIMEOUT_S,
        metavar="SECONDS",
        help="a step running longer turns /health to 503 and ends the request(s) that may "
        "have caused it (the engine thread's watchdog)",
    )
    sec.add_argument(
        "--enable-kv-view",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve the live KV view (/v1/kv/stream; default: only when listening on loopback "
        "alone, as even its anonymous rows show other users' activity)",
    )
    add_server_limit_args(sec)


def check_serve_args(args: argparse.Namespace) -> None:
    for name in ("max_request_body_bytes", "max_header_bytes", "ws_max_active"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_queue_len < -1:
        raise SystemExit("--max-queue-len must be >= 0, or -1 for no limit")
    if not args.log_stats_interval > 0:
        raise SystemExit("--log-stats-interval must be > 0")
    if not 0 < args.engine_step_timeout < float("inf"):
        raise SystemExit("--engine-step-timeout must be > 0 seconds")
    if args.ssl_keyfile and not args.ssl_certfile:
        raise SystemExit("--ssl-keyfile needs --ssl-certfile")
    for name in ("ssl_keyfile", "ssl_certfile"):
        path = getattr(args, name)
        if path and not os.path.isfile(path):
            raise SystemExit(f"--{name.replace('_', '-')} {path}: no such file")
    if args.root_path and (not args.root_path.startswith("/") or args.root_path.endswith("/")):
        raise SystemExit("--root-path must start with '/' and not end with one (e.g. /llm)")
    check_server_limit_args(args)


def served_name(model: str | None) -> str:
    from streamkv.models.loader import DEFAULT_MODEL_NAME

    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model.rstrip("/"))
    return path.stem if path.suffix == ".gguf" else path.name


def serving_backend(device: str, backend: str | None) -> str | None:
    """The executor ``serve`` uses: as asked, else worker processes (``mp``) on a GPU.

    In one process the engine thread runs the model's torch calls and shares the GIL with
    the event loop that streams the tokens; on an H200 that server made 0.65x the offline
    engine's tokens/s, against 0.97x with the model in a worker process (docs/benchmarks.md,
    "Server overhead"). On the CPU the model's kernels release the GIL for long stretches
    and the in-process server kept up (1.02x), so it stays in one process there.
    """
    if backend is not None:
        return backend
    on_gpu = device.startswith("cuda") or (device == "auto" and _cuda_available())
    return "mp" if on_gpu else None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
