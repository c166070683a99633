"""Static bounds on a structured-output spec, checked before the grammar engine sees it.

Why: xgrammar's compile time grows with what a spec asks for, not only with its length (the
audit of issue 26: 5,000 required properties took ~15 s, a 1 MB regex alternation froze the
engine for minutes at 3.6 GB RSS). A compile also runs under a time budget
(engine/grammar_compiler.py), but a compile past its budget still holds a compile thread
until it ends, so anything a reader can see is too big is refused here, in microseconds per
kilobyte, with the limit it broke. Each refusal is an InvalidParameter naming
``structured_outputs`` (the front end reports it under the field the request used).

``$ref`` resolves only inside the document (``#...``): the grammar engine must never be
asked to fetch a URL or read a file.
"""

from __future__ import annotations

import re
from typing import Any

from streamkv.sampling_params import InvalidParameter

MAX_SPEC_CHARS = 64 * 1024  # a schema's JSON text, a regex, a grammar, the choices together
MAX_REGEX_CHARS = 16 * 1024  # a regex's alternations compile to automata: tighter
MAX_BRANCHES = 1024  # enum values, anyOf / oneOf / allOf branches, choices
MAX_PROPERTIES = 256  # properties (and required names) of one object schema
MAX_SCHEMA_NODES = 10_000  # sub-schemas, all levels together
MAX_DEPTH = 64  # schema nesting
MAX_REPEAT = 10_000  # {m,n} counts, minLength / maxLength / minItems / maxItems, ...

_COUNT_KEYS = (
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "minContains",
    "maxContains",
)
_BRANCH_KEYS = ("enum", "anyOf", "oneOf", "allOf", "prefixItems")
_VALUES = ("enum", "const", "default", "examples", "required")
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def _refuse(why: str) -> InvalidParameter:
    return InvalidParameter(
        "structured_outputs",
        f'structured_outputs: {why} (docs/api.md, "Limits a request must respect").',
    )


def check_spec(kind: str, text: str) -> None:
    """Raise InvalidParameter when the spec (``StructuredOutputs.key()``) exceeds a limit."""
    limit = MAX_REGEX_CHARS if kind == "regex" else MAX_SPEC_CHARS
    if len(text) > limit:
        raise _refuse(f"the {kind} is {len(text)} characters long; the limit is {limit}")
    if kind in ("regex", "grammar"):
        _check_repeats(kind, text)
    elif kind == "choice":
        import json

        choices = json.loads(text)
        if len(choices) > MAX_BRANCHES:
            raise _refuse(f"choice holds {len(choices)} strings; the limit is {MAX_BRANCHES}")
    elif kind == "json":
        import json

        _check_schema(json.loads(text))


def _check_repeats(kind: str, text: str) -> None:
    for m in _REPEAT.finditer(text):
        for count in m.groups():
            if count and int(count) > MAX_REPEAT:
                raise _refuse(
                    f"the {kind} repeats {int(count)} times "
                    f"({m.group(0)}); the limit is {MAX_REPEAT}"
                )


def _check_schema(schema: Any) -> None:
    """Walk every sub-schema (iteratively: a deep document must not overflow the stack)."""
    stack: list[tuple[Any, int]] = [(schema, 0)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        if isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
            continue
        if not isinstance(node, dict):
            continue
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise _refuse(f"the schema has more than {MAX_SCHEMA_NODES} sub-schemas")
        if depth > MAX_DEPTH:
            raise _refuse(f"the schema nests deeper than {MAX_DEPTH} levels")
        _check_node(node)
        for k, v in node.items():
            if k in _VALUES:
                continue  # data, not schemas
            if k in _MAPS and isinstance(v, dict):
                stack.extend((s, depth + 1) for s in v.values())  # a property may be named "$ref"
            else:
                stack.append((v, depth + 1))


def _check_node(node: dict) -> None:
    for key in ("$ref", "$dynamicRef", "$recursiveRef"):
        ref = node.get(key)
        if ref is not None and (not isinstance(ref, str) or not ref.startswith("#")):
            raise _refuse(
                f"{key} {str(ref)[:80]!r} points outside the document; only local references "
                '("#/...") are resolved'
            )
    for key in _COUNT_KEYS:
        v = node.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and v > MAX_REPEAT:
            raise _refuse(f"{key} is {v}; the limit is {MAX_REPEAT}")
    for key in _BRANCH_KEYS:
        v = node.get(key)
        if isinstance(v, list) and len(v) > MAX_BRANCHES:
            raise _refuse(f"{key} holds {len(v)} entries; the limit is {MAX_BRANCHES}")
    for key in (
        "properties",
        "required",
        "patternProperties",
        "dependentRequired",
        "$defs",
        "definitions",
    ):
        v = node.get(key)
        if isinstance(v, dict | list) and len(v) > MAX_PROPERTIES:
            raise _refuse(f"{key} holds {len(v)} entries; the limit is {MAX_PROPERTIES}")
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        if len(pattern) > MAX_REGEX_CHARS:
            raise _refuse(
                f"a pattern is {len(pattern)} characters long; the limit is {MAX_REGEX_CHARS}"
            )
        _check_repeats("pattern", pattern)
