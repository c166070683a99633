"""Strict JSON bodies, and validation through the request models (errors.py has the error
shape).

A body is parsed as strict JSON (``parse_json_body``), then validated by its endpoint's
pydantic model (requests.py) with ``validate``. Types are coerced as vLLM's models
coerce them (pydantic's lax mode: ``"5"`` is 5, ``"true"`` is true); ``serve
--strict-request-types`` refuses them, as OpenAI does. A pydantic error becomes a 400 whose
``param`` is the error's location (``messages[0].content``). Fields no model declares are
ignored and named in one warning per request, as vLLM does: strict rejection breaks the
clients that send newer OpenAI fields. Fields we know but cannot honour (they would change
the output) are declared as ``Unsupported`` and refused by name; the fields that change
nothing are ``PassiveFields``.
"""

from __future__ import annotations

import json
import logging
from contextvars import ContextVar
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from streamkv.entrypoints.openai.errors import ERROR_FORMAT, ERROR_FORMATS, APIError

logger = logging.getLogger("streamkv.entrypoints.requests")

M = TypeVar("M", bound=BaseModel)


def parse_json_body(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(
            f"the request body is not valid UTF-8 (byte {e.start})", code="invalid_utf8"
        ) from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except APIError:
        raise
    except (ValueError, RecursionError) as e:
        raise APIError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", code="invalid_json")
    _check_strings(body)
    return body


def _reject_constant(name: str):
    raise APIError(f"{name} is not a valid JSON number", code="invalid_json")


def _check_strings(body: dict) -> None:
    """Lone surrogates (``"\\ud800"``) parse as JSON but are not text; reject them here.
    Iterative: a deeply nested body must not overflow the stack."""
    todo: list[Any] = [body]
    while todo:
        value = todo.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise APIError(
                        "the request contains invalid Unicode (a lone surrogate)",
                        code="invalid_utf8",
                    ) from None
        elif isinstance(value, dict):
            todo.extend(value.keys())
            todo.extend(value.values())
        elif isinstance(value, list):
            todo.extend(value)


class OpenAIModel(BaseModel):
    """pydantic's lax types, as vLLM's (``validate`` makes them strict under
    --strict-request-types); ``null`` means "not given" (OpenAI's clients send it for unset
    fields); unknown fields are kept aside, for the one warning ``validate`` logs."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


def _refuse(value: Any) -> Any:
    if value in (False, 0, "", [], {}):  # the default behaviour, spelled out: harmless
        return value
    raise ValueError("is not supported by this server")


# A field we know and cannot honour: it would change the output, so a value other than its
# default is a 400, never silently ignored.
Unsupported = Annotated[
    Any, AfterValidator(_refuse), Field(description="Not supported: a 400 unless unset.")
]
# JSON integers wider than 64 bits fit no engine field (a seed is hashed as 64 bits).
Int = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]


class PassiveFields(OpenAIModel):
    """The fields both generation endpoints take that change nothing in the output (inert:
    accepted, documented) and vLLM's extras this engine cannot honour (a 400 unless unset):
    the request models' passive part (requests.py has the fields that shape the output)."""

    # Inert: OpenAI fields that do not change the output.
    user: str | None = Field(None, description="inert: an end-user id")
    metadata: dict[str, str] | None = Field(None, description="inert")
    store: bool | None = Field(None, description="inert: nothing is stored")
    service_tier: str | None = Field(None, description="inert")
    prompt_cache_key: str | None = Field(None, description="inert: prefix caching is automatic")
    safety_identifier: str | None = Field(None, description="inert")
    # vLLM extras this engine does not implement.
    priority: Unsupported = None
    bad_words: Unsupported = None
    logits_processors: Unsupported = None


# Whether this request's types are strict: the app's --strict-request-types, set for each
# request by ``RequestTypes``. A context variable, because four handlers in three modules
# validate bodies and the choice is the app's, not theirs.
_STRICT_TYPES: ContextVar[bool] = ContextVar("streamkv_strict_request_types", default=False)
# The app's --tools-system-prompt, read by the chat handlers (they pass it on to the
# tokenizer thread, which a context variable does not reach).
TOOLS_SYSTEM_PROMPT: ContextVar[bool] = ContextVar("streamkv_tools_system_prompt", default=True)


class RequestTypes:
    """ASGI middleware: the app's choices where vLLM and OpenAI differ, for the requests it
    passes on: ``strict`` types or lax ones, the error ``error_format``, and whether tools go
    into a system message for templates that ignore them (``tools_prompt``)."""

    def __init__(
        self, app: Any, strict: bool, error_format: str = "openai", tools_prompt: bool = True
    ) -> None:
        if error_format not in ERROR_FORMATS:
            raise ValueError(f"error_format must be one of {ERROR_FORMATS}, got {error_format!r}")
        self.app, self.strict = app, strict
        self.error_format, self.tools_prompt = error_format, tools_prompt

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        tokens = (
            _STRICT_TYPES.set(self.strict),
            ERROR_FORMAT.set(self.error_format),
            TOOLS_SYSTEM_PROMPT.set(self.tools_prompt),
        )
        try:
            await self.app(scope, receive, send)
        finally:
            _STRICT_TYPES.reset(tokens[0])
            ERROR_FORMAT.reset(tokens[1])
            TOOLS_SYSTEM_PROMPT.reset(tokens[2])


def validate(cls: type[M], body: dict, where: str = "", strict: bool | None = None) -> M:
    """``body`` as a ``cls``, or an APIError naming the first bad field. ``where`` prefixes
    every ``param`` (the WebSocket's ``params.``); ``strict`` (default: the app's setting)
    refuses ``"5"`` for 5 and ``"true"`` for true."""
    try:
        model = cls.model_validate(body, strict=_STRICT_TYPES.get() if strict is None else strict)
    except ValidationError as e:
        raise error_from_validation(e, where) from None
    ignored = ignored_fields(model, where)
    if ignored:
        logger.warning("ignored unknown request fields: %s", ", ".join(ignored))
    return model


def param_of(loc: tuple[str | int, ...], where: str = "") -> str:
    """A pydantic location as the OpenAI ``param``: ``("messages", 0, "content")`` →
    ``messages[0].content``. Union members are tagged ``<like-this>`` in the models
    (callable discriminators), and tags are no part of the field's name."""
    out = where.rstrip(".")
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.startswith("<"):
            out += f".{part}" if out else part
    return out


def error_from_validation(e: ValidationError, where: str = "") -> APIError:
    err = e.errors(include_url=False)[0]
    param = param_of(err["loc"], where) or None
    kind, name = err["type"], f"'{param}'" if param else "the request"
    if kind == "missing":
        message = f"{name} is required"
    elif kind == "value_error":
        message = f"{name} {err['ctx']['error']}"
    else:
        message = f"{name}: {err['msg']}"
        if "input" in err and not isinstance(err["input"], dict):
            message += f", got {json.dumps(err['input'], default=str)[:40]}"
    return APIError(message, param=param)


_PLAIN = (str, int, float, bool, dict)


def ignored_fields(model: BaseModel, where: str = "") -> list[str]:
    """The unknown fields of ``model`` and of every model inside it, as ``param`` paths.
    Only model values and lists of models are walked (a prompt's token ids are not)."""
    out: list[str] = []
    todo: list[tuple[str, BaseModel]] = [(where.rstrip("."), model)]
    while todo:
        path, value = todo.pop()
        out.extend(f"{path}.{k}" if path else k for k in value.__pydantic_extra__ or ())
        fields = type(value).__pydantic_fields__
        for name, v in value.__dict__.items():
            if v is None or type(v) in _PLAIN:  # most fields: skip BaseModel's slower isinstance
                continue
            if isinstance(v, list) and v and isinstance(v[0], BaseModel):
                key = fields[name].alias or name
                todo.extend(
                    (f"{path}.{key}[{i}]" if path else f"{key}[{i}]", item)
                    for i, item in enumerate(v)
                )
            elif isinstance(v, BaseModel):
                key = fields[name].alias or name
                todo.append((f"{path}.{key}" if path else key, v))
    return sorted(out)
