"""The OpenAI error shape (``APIError``), or vLLM's under ``serve --error-format vllm``, and
every way the engine can refuse or drop a request mapped to it once (``engine_error``), so
that HTTP, SSE and the WebSocket report the same status and ``code`` for the same failure.
"""

from __future__ import annotations

from contextvars import ContextVar
from http import HTTPStatus

from streamkv.engine.recovery import EngineRestartedError
from streamkv.engine.request_book import (
    EngineDeadError,
    EngineNotReadyError,
    EngineRecoveringError,
    EngineStoppingError,
    QueueFullError,
    RequestAbortedError,
)
from streamkv.engine.tokenizer_lanes import TokenizerBusyError

# The app's --error-format, set for each request by protocol.py's ``RequestTypes`` and read
# by ``APIError.body`` wherever an error is written (JSON, SSE, the WebSocket).
ERROR_FORMAT: ContextVar[str] = ContextVar("streamkv_error_format", default="openai")
ERROR_FORMATS = ("openai", "vllm")


class APIError(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type = message, status, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict:
        if ERROR_FORMAT.get() == "vllm":  # --error-format vllm: the exception's name, the status
            return {
                "error": {
                    "message": self.message,
                    "type": vllm_error_type(self.status),
                    "param": self.param,
                    "code": self.status,
                }
            }
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def vllm_error_type(status: int) -> str:
    """vLLM's ``type`` for a status: its error class's name (400 ``BadRequestError``, 404
    ``NotFoundError``, 500 ``InternalServerError``, 503 ``ServiceUnavailableError``)."""
    try:
        name = "".join(HTTPStatus(status).phrase.title().split()).replace("-", "")
    except ValueError:
        name = "Unknown"
    return name if name.endswith("Error") else name + "Error"


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
