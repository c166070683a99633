"""OpenAI request bodies → validated records with a ``SamplingParams``; the OpenAI error shape.

Every check here turns bad input into an ``APIError`` (a 4xx in the OpenAI shape) that
names the offending field. Range checks on sampling fields live in ``SamplingParams`` and
are re-raised here with the field name as ``param``. A field we do not implement is an
error, not silently ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from streamkv.sampling_params import SamplingParams

MAX_SAMPLES = 16  # cap on n and best_of
MAX_LOGPROBS = 20  # cap on completions' logprobs and chat's top_logprobs
MAX_STOP = 32  # stop strings per request (OpenAI allows 4)
MAX_STOP_CHARS = 1024  # per stop string: the engine holds back up to this many characters per step
MAX_LOGIT_BIAS = 1024  # tokens in one logit_bias
_INT64 = (-(2**63), 2**64 - 1)
CHAT_ROLES = ("system", "developer", "user", "assistant")


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
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def parse_json_body(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(f"the request body is not valid UTF-8 (byte {e.start})", code="invalid_utf8") from None
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
                    raise APIError("the request contains invalid Unicode (a lone surrogate)", code="invalid_utf8") from None
        elif isinstance(value, dict):
            todo.extend(value.keys())
            todo.extend(value.values())
        elif isinstance(value, list):
            todo.extend(value)


class Fields:
    """Typed access to a request body; ``finish()`` rejects fields nobody asked for."""

    def __init__(self, body: dict, where: str = "") -> None:
        self.body, self.where, self.used = body, where, set()

    def _raw(self, name: str) -> Any:
        self.used.add(name)
        return self.body.get(name)

    def bad(self, name: str, why: str) -> APIError:
        return APIError(f"'{self.where}{name}' {why}", param=self.where + name)

    def get(self, name: str, kind: str, default: Any = None, required: bool = False) -> Any:
        v = self._raw(name)
        if v is None:
            if required:
                raise self.bad(name, "is required")
            return default
        ok = {
            "int": isinstance(v, int) and not isinstance(v, bool),
            "number": isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
            "bool": isinstance(v, bool),
            "str": isinstance(v, str),
            "list": isinstance(v, list),
            "dict": isinstance(v, dict),
        }[kind]
        if not ok:
            names = {"int": "an integer", "number": "a number", "bool": "a boolean", "str": "a string",
                     "list": "an array", "dict": "an object"}
            raise self.bad(name, f"must be {names[kind]}, got {json.dumps(v)[:40]}")
        if kind == "int" and not _INT64[0] <= v <= _INT64[1]:
            raise self.bad(name, "is out of range")
        return float(v) if kind == "number" else v

    def capped(self, name: str, lo: int, hi: int, default: int | None = None) -> int | None:
        v = self.get(name, "int", default)
        if v is not None and not lo <= v <= hi:
            raise self.bad(name, f"must be between {lo} and {hi}, got {v}")
        return v

    def unsupported(self, name: str, allowed: tuple = ()) -> None:
        v = self._raw(name)
        if v is not None and v not in allowed:
            raise self.bad(name, "is not supported by this server")

    def finish(self) -> None:
        extra = sorted(set(self.body) - self.used)
        if extra:
            raise APIError(f"unrecognized request argument: '{self.where}{extra[0]}'", param=self.where + extra[0])


@dataclass
class StreamOptions:
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False


@dataclass
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]
    params: SamplingParams
    stream: StreamOptions
    echo: bool
    add_special_tokens: bool
    user: str | None


@dataclass
class ChatRequest:
    model: str | None
    messages: list[dict]
    params: SamplingParams
    stream: StreamOptions
    logprobs: bool
    add_generation_prompt: bool
    add_special_tokens: bool
    user: str | None


def _stream_options(f: Fields) -> StreamOptions:
    stream = f.get("stream", "bool", False)
    opts = f.get("stream_options", "dict")
    if opts is None:
        return StreamOptions(stream)
    if not stream:
        raise f.bad("stream_options", "is only allowed with stream=true")
    g = Fields(opts, "stream_options.")
    out = StreamOptions(stream, g.get("include_usage", "bool", False), g.get("continuous_usage_stats", "bool", False))
    g.finish()
    return out


def _stop(f: Fields) -> list[str] | None:
    v = f._raw("stop")
    if v is None:
        return v
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise f.bad("stop", "must be a string or an array of strings")
    if len(stops) > MAX_STOP:
        raise f.bad("stop", f"may hold at most {MAX_STOP} strings")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise f.bad("stop", f"strings may be at most {MAX_STOP_CHARS} characters long")
    return v


def _int_list(f: Fields, name: str) -> list[int] | None:
    v = f.get(name, "list")
    if v is not None and not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise f.bad(name, "must be an array of integers")
    return v


def _logit_bias(f: Fields) -> dict[int, float] | None:
    """OpenAI's form: an object whose keys are token ids as decimal strings (SamplingParams
    checks the values)."""
    v = f.get("logit_bias", "dict")
    if not v:
        return None
    if len(v) > MAX_LOGIT_BIAS:
        raise f.bad("logit_bias", f"may hold at most {MAX_LOGIT_BIAS} tokens")
    out = {}
    for key, bias in v.items():
        digits = isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 18
        tid = int(key) if digits else None
        if tid is None:
            raise f.bad("logit_bias", f"keys must be token ids, got {str(key)[:40]!r}")
        out[tid] = bias
    return out


def _sampling(f: Fields, max_tokens: int | None, logprobs: int | None, stream: bool) -> SamplingParams:
    n = f.capped("n", 1, MAX_SAMPLES, 1)
    best_of = f.capped("best_of", 1, MAX_SAMPLES)
    beam = f.get("use_beam_search", "bool", False)
    kwargs = dict(
        n=n, best_of=best_of, max_tokens=max_tokens, logprobs=logprobs, stop=_stop(f),
        stop_token_ids=_int_list(f, "stop_token_ids"),
        # Beam search is deterministic: it defaults to (and needs) temperature 0.
        temperature=f.get("temperature", "number", 0.0 if beam else 1.0),
        top_p=f.get("top_p", "number", 1.0),
        top_k=f.get("top_k", "int", -1),
        min_p=f.get("min_p", "number", 0.0),
        seed=f.get("seed", "int"),
        presence_penalty=f.get("presence_penalty", "number", 0.0),
        frequency_penalty=f.get("frequency_penalty", "number", 0.0),
        repetition_penalty=f.get("repetition_penalty", "number", 1.0),
        ignore_eos=f.get("ignore_eos", "bool", False),
        min_tokens=f.get("min_tokens", "int", 0),
        use_beam_search=beam,
        length_penalty=f.get("length_penalty", "number", 1.0),
        skip_special_tokens=f.get("skip_special_tokens", "bool", True),
        include_stop_str_in_output=f.get("include_stop_str_in_output", "bool", False),
    )
    early = f._raw("early_stopping")
    if early is not None:
        if early not in (True, False, "never"):
            raise f.bad("early_stopping", "must be true, false or \"never\"")
        kwargs["early_stopping"] = early
    kwargs["logit_bias"] = _logit_bias(f)
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:  # InvalidParameter names its field
        raise APIError(str(e), param=getattr(e, "param", None) or str(e).split(" ", 1)[0]) from None
    if stream and params.use_beam_search:
        raise f.bad("use_beam_search", "cannot be combined with stream=true")
    if stream and params.best_of > params.n:
        raise f.bad("best_of", "must equal n with stream=true (the best samples are only known at the end)")
    return params


def _prompts(f: Fields) -> list[str | list[int]]:
    v = f._raw("prompt")
    if v is None:
        raise f.bad("prompt", "is required")
    if isinstance(v, str):
        v = [v]
    elif isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        v = [v]
    if not isinstance(v, list) or not v:
        raise f.bad("prompt", "must be a string, an array of strings or token ids, and not empty")
    for p in v:
        is_ids = isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
        if not (isinstance(p, str) or is_ids):
            raise f.bad("prompt", "must be a string, an array of strings, or an array of token-id arrays")
        if not p:
            raise f.bad("prompt", "must not be empty")
    if len(v) > MAX_SAMPLES:
        raise f.bad("prompt", f"may hold at most {MAX_SAMPLES} prompts")
    return v


def parse_completion(body: dict) -> CompletionRequest:
    f = Fields(body)
    model = f.get("model", "str")
    prompts = _prompts(f)
    stream = _stream_options(f)
    echo = f.get("echo", "bool", False)
    logprobs = f.capped("logprobs", 0, MAX_LOGPROBS)
    if echo and logprobs is not None:
        raise f.bad("echo", "cannot be combined with logprobs (prompt logprobs are not computed)")
    params = _sampling(f, f.get("max_tokens", "int", 16), logprobs, stream.stream)
    f.unsupported("suffix")
    add_special = f.get("add_special_tokens", "bool", True)
    user = f.get("user", "str")
    f.finish()
    return CompletionRequest(model, prompts, params, stream, echo, add_special, user)


def parse_messages(f: Fields) -> list[dict]:
    v = f.get("messages", "list", required=True)
    if not v:
        raise f.bad("messages", "must not be empty")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise f.bad(f"messages[{i}]", "must be an object")
        g = Fields(m, f"{f.where}messages[{i}].")
        role = g.get("role", "str", required=True)
        if role not in CHAT_ROLES:
            raise g.bad("role", f"must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        content = g._raw("content")
        if isinstance(content, list):
            content = "\n".join(_text_part(g, j, part) for j, part in enumerate(content))
        elif not isinstance(content, str):
            raise g.bad("content", "must be a string or an array of text parts")
        msg = {"role": "system" if role == "developer" else role, "content": content}
        name = g.get("name", "str")
        if name is not None:
            msg["name"] = name
        g.finish()
        out.append(msg)
    return out


def _text_part(g: Fields, j: int, part: Any) -> str:
    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
        raise g.bad(f"content[{j}]", "must be a text part {\"type\": \"text\", \"text\": ...}; other content types are not supported")
    return part["text"]


def parse_chat(body: dict, where: str = "") -> ChatRequest:
    f = Fields(body, where)
    model = f.get("model", "str")
    messages = parse_messages(f)
    stream = _stream_options(f)
    logprobs = f.get("logprobs", "bool", False)
    top = f.capped("top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not logprobs:
        raise f.bad("top_logprobs", "needs logprobs=true")
    max_tokens = f.get("max_completion_tokens", "int")
    legacy = f.get("max_tokens", "int")
    if max_tokens is not None and legacy is not None and max_tokens != legacy:
        raise f.bad("max_tokens", "conflicts with max_completion_tokens")
    params = _sampling(f, max_tokens if max_tokens is not None else legacy, (top or 0) if logprobs else None, stream.stream)
    f.unsupported("response_format", allowed=({"type": "text"},))
    f.unsupported("tools", allowed=([],))
    f.unsupported("tool_choice", allowed=("none",))
    f.unsupported("parallel_tool_calls")
    add_gen = f.get("add_generation_prompt", "bool", True)
    add_special = f.get("add_special_tokens", "bool", False)
    user = f.get("user", "str")
    f.finish()
    return ChatRequest(model, messages, params, stream, logprobs, add_gen, add_special, user)
