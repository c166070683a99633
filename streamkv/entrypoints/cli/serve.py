"""``streamkv serve``: the command that runs the app of entrypoints/server/app.py on uvicorn
(its flags are serve_args.py's; the socket it binds before the model loads, listener.py's).

Start-up, as the operator sees it: uvicorn listens at once and ``/health`` answers 503
while the model loads; one ``ready: URL (model, KV blocks, max context)`` line follows when
a request can be served (the engine is loaded and the socket is bound), then a stats line
every few seconds while there is traffic (``--disable-log-stats`` turns it off).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from streamkv.entrypoints.cli.listener import bind_listener, fit_open_files, url_host

logger = logging.getLogger("streamkv.entrypoints.server")


def add_serve_parser(sub) -> argparse.ArgumentParser:
    from streamkv.entrypoints.cli.common import HelpFormatter
    from streamkv.entrypoints.cli.serve_args import add_serve_args

    p = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP + WebSocket server",
        formatter_class=HelpFormatter,
        allow_abbrev=False,
        description="Serve a model over an OpenAI-compatible HTTP API (with SSE "
        "streaming) and a WebSocket chat; see docs/api.md.",
    )
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)
    return p


def cmd_serve(args: argparse.Namespace) -> int:
    from streamkv.entrypoints.cli.serve_args import check_serve_args

    check_serve_args(args)
    # Bound before anything loads: a port in use fails now, not after the model has loaded.
    listener = bind_listener(args.host, args.port)
    config, template = resolve_engine_config(args)
    engine = make_engine(args, config, template)
    startup = Startup(args, config, engine)
    app = make_app(args, engine, startup)
    warn_if_public(args)
    check_loop(args)
    startup.server = make_server(args, app, engine)
    # uvicorn says nothing when given the socket; this line says what /health will answer.
    logger.info(
        "listening on %s://%s:%d%s; loading the model (/health answers 503 until the "
        "'ready:' line)",
        startup.scheme,
        url_host(args.host),
        listener.getsockname()[1],
        args.root_path,
    )
    run_until_stopped(startup, listener)


def resolve_engine_config(args: argparse.Namespace):
    """The engine's config, verified, and the chat template: a bad flag fails here, before
    the server listens."""
    from streamkv.entrypoints.args import engine_kwargs
    from streamkv.entrypoints.cli.common import load_chat_template
    from streamkv.entrypoints.cli.serve_args import serving_backend
    from streamkv.entrypoints.llm import engine_config

    kwargs = engine_kwargs(args)
    kwargs["distributed_executor_backend"] = serving_backend(
        args.device, args.distributed_executor_backend
    )
    config = engine_config(args.model, **kwargs)
    try:
        config.verify()
        template = load_chat_template(args.chat_template) if args.chat_template else None
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return config, template


def make_engine(args: argparse.Namespace, config, template):
    """The async engine; it builds (and rebuilds after a worker restart) the engine proper."""
    from streamkv.engine.async_engine import AsyncEngine
    from streamkv.engine.recovery import RestartBudget
    from streamkv.entrypoints.cli.common import set_chat_template
    from streamkv.entrypoints.llm import build_engine
    from streamkv.models.loader import phase

    def build():
        with phase("loading the model and allocating the KV cache"):
            engine = build_engine(config)
        if template is not None:
            set_chat_template(engine.tokenizer, template)  # again after a worker restart
        return engine

    return AsyncEngine(
        build,
        restarts=RestartBudget(limit=args.max_worker_restarts),
        log_stats_interval=None if args.disable_log_stats else args.log_stats_interval,
        log_requests=args.enable_log_requests,
        step_timeout_s=args.engine_step_timeout,
    )


class Startup:
    """The app's two start-up callbacks, which need the server built after the app."""

    def __init__(self, args: argparse.Namespace, config, engine) -> None:
        from streamkv.entrypoints.cli.serve_args import served_name

        self.args, self.config, self.engine = args, config, engine
        self.names = args.served_model_name or [served_name(args.model)]
        self.scheme = "https" if args.ssl_certfile else "http"
        self.failed: list[bool] = []
        self.server = None

    def on_load_failure(self) -> None:
        self.failed.append(True)
        self.server.should_exit = True

    async def announce(self) -> None:
        args, server = self.args, self.server
        while not server.started:  # the engine may be loaded before the socket is bound
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1] if server.servers else args.port
        info = self.engine.info
        short = kv_pool_shortfall(info)
        if short:
            logger.error("%s", short)
            self.on_load_failure()
            return
        logger.info(
            "ready: %s://%s:%d%s (model %s, %d KV blocks of %d tokens, max context %d)",
            self.scheme,
            url_host(args.host),
            port,
            args.root_path,
            self.names[0],
            info.num_kv_blocks,
            info.block_size,
            info.max_model_len,
        )
        if self.config.scheduler.preemption_mode == "swap" and info.num_swap_blocks == 0:
            logger.warning(
                "--preemption-mode swap with no CPU swap blocks (none by default on a CPU): a "
                "request preempted is recomputed instead; set --swap-space or --num-swap-blocks"
            )


def make_app(args: argparse.Namespace, engine, startup: Startup):
    from streamkv.entrypoints.server.app import ServerConfig, build_app
    from streamkv.entrypoints.server.security import HostPolicy

    origins = tuple(o.strip() for arg in args.allowed_origins for o in arg.split(",") if o.strip())
    hosts = HostPolicy.build(args.host, (h for arg in args.allowed_hosts for h in arg.split(",")))
    return build_app(
        engine,
        ServerConfig(
            model_name=startup.names[0],
            model_aliases=tuple(dict.fromkeys(startup.names[1:])),
            api_key=args.api_key or None,
            allowed_origins=origins,
            hosts=hosts,
            max_body_bytes=args.max_request_body_bytes,
            max_header_bytes=args.max_header_bytes,
            max_queue_len=None if args.max_queue_len == -1 else args.max_queue_len,
            sse_keepalive=args.sse_keepalive,
            ws_max_active=args.ws_max_active,
            on_load_failure=startup.on_load_failure,
            auto_tool_choice=args.enable_auto_tool_choice,
            tokens_as_ids=args.return_tokens_as_token_ids,
            on_ready=startup.announce,
            kv_view=args.enable_kv_view,
            strict_request_types=args.strict_request_types,
            error_format=args.error_format,
            tools_system_prompt=args.tools_system_prompt,
        ),
    )


def warn_if_public(args: argparse.Namespace) -> None:
    public = args.host not in ("127.0.0.1", "localhost", "::1")
    if public and not args.api_key:
        logger.warning(
            "serving on %s without --api-key: anyone who can reach it can use it", args.host
        )
    if public and not args.allowed_hosts:
        logger.warning(
            "serving on %s: requests must name the server by the IP address they connect to or "
            "a loopback name; list its DNS names with --allowed-hosts (others get 421)",
            args.host,
        )


def check_loop(args: argparse.Namespace) -> None:
    if args.loop == "uvloop":
        try:
            import uvloop  # noqa: F401
        except ImportError:
            raise SystemExit("error: --loop uvloop: uvloop is not installed") from None


def make_server(args: argparse.Namespace, app, engine):
    import functools

    import uvicorn

    from streamkv.entrypoints.server.connections import (
        ConnectionLimits,
        GuardedH11Protocol,
        QuietDenialWebSocket,
    )
    from streamkv.entrypoints.server.shutdown import DrainingServer

    limits = ConnectionLimits(
        args.timeout_request_head, args.timeout_request_body, fit_open_files(args.limit_concurrency)
    )
    return DrainingServer(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            loop=args.loop,
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


def run_until_stopped(startup: Startup, listener) -> None:
    """Serve until stopped, then end the process with the exit status."""
    server, failed = startup.server, startup.failed
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


def kv_pool_shortfall(info) -> str | None:
    """Why the server must not start, when the KV pool cannot hold one request of the
    context it advertises (vLLM refuses too): every long request would fail one by one."""
    tokens = info.num_kv_blocks * info.block_size
    if tokens >= info.max_model_len:
        return None
    return (
        f"the KV cache holds {tokens} tokens ({info.num_kv_blocks} blocks of {info.block_size}), "
        f"less than one request of the max context {info.max_model_len}: lower --max-model-len "
        f"to {tokens} or less, or give the pool more blocks (--num-kv-blocks, or more memory: "
        "--gpu-memory-utilization on a GPU)"
    )
