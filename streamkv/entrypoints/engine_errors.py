"""Every way the engine can refuse or drop a request, mapped once (``engine_error``) so that
HTTP, SSE and the WebSocket report the same status and ``code`` for the same failure."""

from __future__ import annotations

from streamkv.engine.async_engine import (
    EngineDeadError,
    EngineNotReadyError,
    EngineRecoveringError,
    EngineStoppingError,
    QueueFullError,
    RequestAbortedError,
)
from streamkv.engine.recovery import EngineRestartedError
from streamkv.engine.tokenizer_lanes import TokenizerBusyError
from streamkv.entrypoints.openai_protocol import APIError

ENGINE_ERRORS = (
    EngineDeadError,
    EngineNotReadyError,
    EngineRecoveringError,
    EngineRestartedError,
    EngineStoppingError,
    QueueFullError,
    RequestAbortedError,
    TokenizerBusyError,
)


def engine_error(e: BaseException) -> APIError:
    if isinstance(e, QueueFullError):
        return APIError(
            "the server's request queue is full; retry later",
            429,
            "rate_limit_error",
            code="queue_full",
            headers={"retry-after": "1"},
        )
    if isinstance(e, TokenizerBusyError):
        return APIError(
            str(e), 429, "rate_limit_error", code="tokenizer_busy", headers={"retry-after": "1"}
        )
    if isinstance(e, EngineRecoveringError):
        return APIError(
            str(e),
            503,
            "service_unavailable_error",
            code="engine_recovering",
            headers={"retry-after": "5"},
        )
    code = {
        EngineDeadError: "engine_dead",
        EngineNotReadyError: "engine_loading",
        EngineRestartedError: "engine_restarted",
        EngineStoppingError: "server_shutting_down",
        RequestAbortedError: "request_aborted",
    }[type(e)]
    message = "the request was aborted" if isinstance(e, RequestAbortedError) else str(e)
    return APIError(message, 503, "service_unavailable_error", code=code)


def request_failed(error: str) -> APIError:
    """A request the engine took but could not finish (the KV cache is too small for it, or
    its step failed): the other requests go on."""
    return APIError(
        f"the engine could not finish the request: {error}",
        503,
        "service_unavailable_error",
        code="engine_error",
    )
