"""``streamkv serve``: its flags (grouped as vLLM groups them) and the command that runs the
app of entrypoints/server/app.py on uvicorn.

Start-up, as the operator sees it: uvicorn listens at once and ``/health`` answers 503
while the model loads; one ``ready: URL (model, KV blocks, max context)`` line follows when
a request can be served (the engine is loaded and the socket is bound), then a stats line
every few seconds while there is traffic (``--disable-log-stats`` turns it off).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import socket
import sys

from streamkv.engine.serving_logs import DEFAULT_STATS_INTERVAL_S
from streamkv.entrypoints.args import add_engine_args

logger = logging.getLogger("streamkv.entrypoints.server")


def add_serve_parser(sub) -> argparse.ArgumentParser:
    from streamkv.engine.watchdog import STEP_TIMEOUT_S
    from streamkv.entrypoints.cli.common import (
        HelpFormatter,
        add_common_args,
        add_server_limit_args,
    )

    p = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP + WebSocket server",
        formatter_class=HelpFormatter,
        allow_abbrev=False,
        description="Serve a model over an OpenAI-compatible HTTP API (with SSE "
        "streaming) and a WebSocket chat; see docs/api.md.",
    )
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="local HF directory, .gguf file or shape preset (default: the embedded "
        "SmolLM2-135M-Instruct)",
    )
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
    add_common_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)
    return p


def _check_args(args: argparse.Namespace) -> None:
    from streamkv.entrypoints.cli.common import check_server_limit_args

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


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def cmd_serve(args: argparse.Namespace) -> int:
    import functools

    import uvicorn

    from streamkv.engine.async_engine import AsyncEngine
    from streamkv.engine.recovery import RestartBudget
    from streamkv.entrypoints.args import engine_kwargs
    from streamkv.entrypoints.cli.common import load_chat_template, set_chat_template
    from streamkv.entrypoints.llm import build_engine, engine_config
    from streamkv.entrypoints.server.app import (
        ServerConfig,
        build_app,
        served_name,
        serving_backend,
    )
    from streamkv.entrypoints.server.connections import (
        ConnectionLimits,
        GuardedH11Protocol,
        QuietDenialWebSocket,
    )
    from streamkv.entrypoints.server.security import HostPolicy
    from streamkv.entrypoints.server.shutdown import DrainingServer
    from streamkv.models.loader import phase

    _check_args(args)
    # Bound before anything loads: a port in use fails now, not after the model has loaded.
    listener = bind_listener(args.host, args.port)
    kwargs = engine_kwargs(args)
    kwargs["distributed_executor_backend"] = serving_backend(
        args.device, args.distributed_executor_backend
    )
    config = engine_config(args.model, **kwargs)
    try:
        config.verify()  # a bad flag fails here, before the server listens
        template = load_chat_template(args.chat_template) if args.chat_template else None
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None

    def build():
        with phase("loading the model and allocating the KV cache"):
            engine = build_engine(config)
        if template is not None:
            set_chat_template(engine.tokenizer, template)  # again after a worker restart
        return engine

    engine = AsyncEngine(
        build,
        restarts=RestartBudget(limit=args.max_worker_restarts),
        log_stats_interval=None if args.disable_log_stats else args.log_stats_interval,
        log_requests=args.enable_log_requests,
        step_timeout_s=args.engine_step_timeout,
    )
    origins = tuple(o.strip() for arg in args.allowed_origins for o in arg.split(",") if o.strip())
    hosts = HostPolicy.build(args.host, (h for arg in args.allowed_hosts for h in arg.split(",")))
    failed: list[bool] = []
    server: uvicorn.Server | None = None
    names = args.served_model_name or [served_name(args.model)]
    model_name = names[0]
    scheme = "https" if args.ssl_certfile else "http"

    def on_load_failure() -> None:
        failed.append(True)
        server.should_exit = True

    async def announce() -> None:
        while not server.started:  # the engine may be loaded before the socket is bound
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1] if server.servers else args.port
        info = engine.info
        short = kv_pool_shortfall(info)
        if short:
            logger.error("%s", short)
            on_load_failure()
            return
        logger.info(
            "ready: %s://%s:%d%s (model %s, %d KV blocks of %d tokens, max context %d)",
            scheme,
            url_host(args.host),
            port,
            args.root_path,
            model_name,
            info.num_kv_blocks,
            info.block_size,
            info.max_model_len,
        )
        if config.scheduler.preemption_mode == "swap" and info.num_swap_blocks == 0:
            logger.warning(
                "--preemption-mode swap with no CPU swap blocks (none by default on a CPU): a "
                "request preempted is recomputed instead; set --swap-space or --num-swap-blocks"
            )

    app = build_app(
        engine,
        ServerConfig(
            model_name=model_name,
            model_aliases=tuple(dict.fromkeys(names[1:])),
            api_key=args.api_key or None,
            allowed_origins=origins,
            hosts=hosts,
            max_body_bytes=args.max_request_body_bytes,
            max_header_bytes=args.max_header_bytes,
            max_queue_len=None if args.max_queue_len == -1 else args.max_queue_len,
            sse_keepalive=args.sse_keepalive,
            ws_max_active=args.ws_max_active,
            on_load_failure=on_load_failure,
            auto_tool_choice=args.enable_auto_tool_choice,
            tokens_as_ids=args.return_tokens_as_token_ids,
            on_ready=announce,
            kv_view=args.enable_kv_view,
            strict_request_types=args.strict_request_types,
            error_format=args.error_format,
            tools_system_prompt=args.tools_system_prompt,
        ),
    )
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logger.warning(
            "serving on %s without --api-key: anyone who can reach it can use it", args.host
        )
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.allowed_hosts:
        logger.warning(
            "serving on %s: requests must name the server by "
            "the IP address they connect to or a loopback name; "
            "list its DNS names with --allowed-hosts (others get 421)",
            args.host,
        )
    loop = args.loop
    if loop == "uvloop":
        try:
            import uvloop  # noqa: F401
        except ImportError:
            raise SystemExit("error: --loop uvloop: uvloop is not installed") from None
    limits = ConnectionLimits(
        args.timeout_request_head, args.timeout_request_body, fit_open_files(args.limit_concurrency)
    )
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            loop=loop,
            http=functools.partial(GuardedH11Protocol, limits=limits),
            ws=QuietDenialWebSocket,
            h11_max_incomplete_event_size=args.max_header_bytes,
            ws_max_size=args.max_request_body_bytes,
            timeout_keep_alive=args.timeout_keep_alive,
            log_level=args.log_level.lower(),
            access_log=args.access_log,
            lifespan="on",
            root_path=args.root_path,
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            backlog=max(2048, min(limits.max_connections, 65535)),
        ),
        engine,
        args.shutdown_timeout,
    )
    # uvicorn says nothing when given the socket; this line says what /health will answer.
    bound = listener.getsockname()[1]
    logger.info(
        "listening on %s://%s:%d%s; loading the model "
        "(/health answers 503 until the 'ready:' line)",
        scheme,
        url_host(args.host),
        bound,
        args.root_path,
    )
    status = 1 if failed else 0
    try:
        server.run(sockets=[listener])
    except KeyboardInterrupt:  # uvicorn raises the Ctrl-C again once it has drained
        status = 130
    if server.interrupted:
        status = 130
    # Stopped cleanly by now. The interpreter's own teardown would only add native
    # libraries' warnings (triton's nanobind prints dozens of "leaked" lines): end here.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failed else status)


def bind_listener(host: str, port: int) -> socket.socket:
    """The listening socket, bound now (uvicorn would bind only after its start-up)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise SystemExit(f"error: --host {host}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(
        socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
    )  # as uvicorn: TIME_WAIT is no conflict
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        hint = (
            " (another server is running there: stop it or choose another --port)"
            if e.errno == errno.EADDRINUSE
            else ""
        )
        raise SystemExit(
            f"error: cannot listen on {url_host(host)}:{port}: {e.strerror}{hint}"
        ) from None
    sock.set_inheritable(True)
    return sock


def kv_pool_shortfall(info) -> str | None:
    """Why the server must not start, when the KV pool cannot hold one request of the
    context it advertises (vLLM refuses too): every long request would fail one by one."""
    tokens = info.num_kv_blocks * info.block_size
    if tokens >= info.max_model_len:
        return None
    return (
        f"the KV cache holds {tokens} tokens ({info.num_kv_blocks} "
        f"blocks of {info.block_size}), less than one "
        f"request of the max context {info.max_model_len}: "
        f"lower --max-model-len to {tokens} or less, or give the "
        "pool more blocks (--num-kv-blocks, or more memory: --gpu-memory-utilization on a GPU)"
    )


def fit_open_files(connections: int, spare: int = 256) -> int:
    """Raise this process's open-file limit so that ``connections`` sockets fit beside the
    files it needs itself (``spare``); if the hard limit is lower, cap connections to fit it,
    so that the cap answers the excess with a JSON 503 rather than accept() failing."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + spare
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        soft = new
    if soft != resource.RLIM_INFINITY and soft < want:
        fitted = max(1, soft - spare)
        logger.warning(
            "the open-file limit (%d, hard) fits %d connections, not --limit-concurrency %d; "
            "raise it with `ulimit -n`",
            soft,
            fitted,
            connections,
        )
        return fitted
    return connections
