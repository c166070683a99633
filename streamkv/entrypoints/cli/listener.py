"""The listening socket ``streamkv serve`` binds before the model loads, and the open-file
room its connections need (serve.py runs the server on them)."""

from __future__ import annotations

import errno
import logging
import socket

logger = logging.getLogger("streamkv.entrypoints.server")


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


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
        hint = ""
        if e.errno == errno.EADDRINUSE:
            hint = " (another server is running there: stop it or choose another --port)"
        raise SystemExit(
            f"error: cannot listen on {url_host(host)}:{port}: {e.strerror}{hint}"
        ) from None
    sock.set_inheritable(True)
    return sock


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
