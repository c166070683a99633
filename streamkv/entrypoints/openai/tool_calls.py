"""Tool calls: the JSON schema that forces them, and the parser of the model's own format.

- ``tool_choice`` ``required`` / named: the output is forced through structured outputs, so
  any model calls tools. Named: the output is the arguments object (the tool's
  ``parameters`` schema). Required: a JSON array of ``{"name", "arguments"}`` (at most one
  with ``parallel_tool_calls: false``).
- ``auto``: the model writes Hermes-style calls, ``<tool_call>{"name": ..., "arguments":
  ...}</tool_call>`` (SmolLM2's and Qwen2's format). ``parse_hermes`` splits a whole output
  into content and calls; ``HermesStream`` does it on a stream, holding back the text of a
  call (and anything that may start one) so that calls leave as ``tool_calls`` deltas, never
  as content. A call whose JSON does not parse stays content, as vLLM does; so does an
  unclosed last block, unless its JSON is a whole call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from streamkv.entrypoints.openai.chat_messages import Tool
from streamkv.entrypoints.openai.errors import APIError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_ANY_OBJECT = {"type": "object"}
_DEF_KEYS = ("$defs", "definitions")


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def forced_tool_schema(tools: list[Tool], named: Tool | None, parallel: bool) -> dict[str, Any]:
    if named is not None:
        return named.function.parameters or _ANY_OBJECT
    defs: dict[str, dict[str, Any]] = {}
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "arguments": _hoist_defs(
                    t.function.parameters or _ANY_OBJECT, defs, t.function.name
                ),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    schema.update(defs)
    return schema


def _hoist_defs(
    params: dict[str, Any], defs: dict[str, dict[str, Any]], tool: str
) -> dict[str, Any]:
    """``params`` without its ``$defs`` (or draft-07 ``definitions``), which join ``defs``: a
    ``$ref`` ("#/$defs/X") points from the root of the schema it is in, and a tool's
    parameters are not the root of the combined ``required`` schema. Pydantic writes
    ``$defs`` for any nested model, so most tools need this. The same name defined two ways
    by two tools cannot share the root: a 400."""
    out = params
    for key in _DEF_KEYS:
        own = params.get(key)
        if not isinstance(own, dict):
            continue
        into = defs.setdefault(key, {})
        for name, definition in own.items():
            if into.get(name, definition) != definition:
                raise APIError(
                    f"tool {tool!r} defines '{key}/{name}' differently from another tool; "
                    'tool_choice "required" needs one definition per name',
                    param="tools",
                )
            into[name] = definition
        out = {k: v for k, v in out.items() if k != key}
    return out


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """One OpenAI ``tool_calls`` entry; ``arguments`` as JSON text, as OpenAI sends them."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": text}}


def _call_of(text: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return tool_call(obj["name"], args) if isinstance(args, dict | str) else None


def parse_required(text: str) -> list[dict[str, Any]] | None:
    """The calls of a forced ``required`` output (a JSON array), or None if it did not finish."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    calls = [_call_of(json.dumps(item)) for item in items] if isinstance(items, list) else [None]
    return None if any(c is None for c in calls) else calls


def parse_hermes(text: str, parallel: bool = True) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of a whole output; no call found: the text is all content."""
    stream = HermesStream(parallel)
    content = stream.feed(text) + stream.finish()
    if not stream.calls:
        return text, []
    return content.strip() or None, stream.calls


@dataclass(slots=True)
class HermesStream:
    """Splits streamed text into content and tool calls. ``feed`` returns the content that
    is safe to send; ``calls`` grows as calls complete (``new_calls`` hands out new ones)."""

    parallel: bool = True
    calls: list[dict[str, Any]] = field(default_factory=list)
    _held: str = ""
    _sent_calls: int = 0

    def feed(self, text: str) -> str:
        self._held += text
        out = []
        while True:
            start = self._held.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self._held, OPEN)
                out.append(self._held[: len(self._held) - keep])
                self._held = self._held[len(self._held) - keep :]
                break
            out.append(self._held[:start])
            end = self._held.find(CLOSE, start)
            if end < 0:
                self._held = self._held[start:]
                break
            raw = self._held[start : end + len(CLOSE)]
            call = _call_of(raw[len(OPEN) : -len(CLOSE)].strip())
            if call is None:
                out.append(raw)  # not a call after all: the model's text, sent as such
            elif self.parallel or not self.calls:
                self.calls.append(call)
            self._held = self._held[end + len(CLOSE) :]
        text = "".join(out)
        # Whitespace around calls is the format's, not the model's answer.
        return text if not self.calls or text.strip() else ""

    def finish(self) -> str:
        """What is still held when the output ends. An unclosed last block whose JSON is
        whole is a call (a model may end at EOS before ``</tool_call>``; vLLM's Hermes parser
        takes it too); anything else held is text."""
        held, self._held = self._held, ""
        call = _call_of(held[len(OPEN) :].strip()) if held.startswith(OPEN) else None
        if call is None:
            return held
        if self.parallel or not self.calls:
            self.calls.append(call)
        return ""

    def new_calls(self) -> list[tuple[int, dict[str, Any]]]:
        fresh = list(enumerate(self.calls))[self._sent_calls :]
        self._sent_calls = len(self.calls)
        return fresh


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
