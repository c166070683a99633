"""Hostile structured-output specs (issue 26): each is refused with an InvalidParameter naming
``structured_outputs`` before any compile, or compiled off the engine thread under a budget;
``$ref`` never leaves the document; compiled grammars are cached by content."""

from __future__ import annotations

import json
import threading
import time

import pytest

from streamkv.engine.grammar_compiler import CompileCache
from streamkv.engine.grammar_limits import MAX_REPEAT, check_spec
from streamkv.sampling_params import InvalidParameter, StructuredOutputs

HOSTILE = {
    "1 MB alternation": {"regex": "|".join(f"word{i}" for i in range(120_000))},
    "a{0,1000000}": {"regex": "a{0,1000000}"},
    "10,000-string enum": {"json": {"enum": [f"s{i}" for i in range(10_000)]}},
    "5,000 required": {
        "json": {
            "type": "object",
            "properties": {f"p{i}": {"type": "integer"} for i in range(5000)},
            "required": [f"p{i}" for i in range(5000)],
        }
    },
    "minLength 10^6": {"json": {"type": "string", "minLength": 10**6}},
    "minItems 10^6": {"json": {"type": "array", "items": {"type": "integer"}, "minItems": 10**6}},
    "2,000 anyOf": {"json": {"anyOf": [{"const": f"v{i}"} for i in range(2000)]}},
    "external $ref": {"json": {"$ref": "https://example.com/schema.json"}},
    "file $ref": {"json": {"type": "object", "properties": {"a": {"$ref": "file:///etc/passwd"}}}},
    "deep nesting": {"json": json.loads('{"items":' * 200 + "{}" + "}" * 200)},
    "grammar repeat": {"grammar": 'root ::= "a"{0,1000000}'},
    "10,000 choices": {"choice": [f"c{i}" for i in range(10_000)]},
    "pattern repeat": {"json": {"type": "string", "pattern": "x{99999}"}},
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_specs_are_refused_before_compiling(name: str) -> None:
    spec = StructuredOutputs(**HOSTILE[name])
    t0 = time.monotonic()
    with pytest.raises(InvalidParameter) as e:
        check_spec(*spec.key())
    assert time.monotonic() - t0 < 1.0
    assert e.value.param == "structured_outputs" and "Limits a request must respect" in str(e.value)


@pytest.mark.parametrize(
    "spec",
    [
        {
            "json": {
                "type": "object",
                "properties": {"$ref": {"type": "string"}, "a": {"$ref": "#/$defs/x"}},
                "$defs": {"x": {"type": "integer"}},
            }
        },
        {"json": {"type": "string", "maxLength": MAX_REPEAT}},
        {"regex": "[a-z]{1,64}@[a-z]{1,32}\\.com"},
        {"choice": ["red", "green", "blue"]},
    ],
)
def test_ordinary_specs_pass_the_limits(spec: dict) -> None:
    check_spec(*StructuredOutputs(**spec).key())


def test_a_slow_compile_is_refused_at_its_budget_and_the_refusal_cached() -> None:
    release = threading.Event()
    calls = []

    def slow(kind: str, text: str) -> str:
        calls.append(text)
        release.wait(5)
        return "compiled"

    cache = CompileCache(slow, size=4, timeout_s=0.2)
    try:
        t0 = time.monotonic()
        with pytest.raises(InvalidParameter) as e:
            cache.compile_now("regex", "a+")
        assert time.monotonic() - t0 < 2.0 and "took longer than" in str(e.value)
        release.set()
        with pytest.raises(InvalidParameter):
            cache.compile_now("regex", "a+")  # the same spec again: refused at once
        assert calls == ["a+"]
    finally:
        release.set()
        cache.shutdown()


def test_a_compile_calls_back_every_waiter_once_and_is_cached_by_content() -> None:
    gate = threading.Event()
    cache = CompileCache(lambda kind, text: (gate.wait(5), text)[1], size=4, timeout_s=5)
    try:
        seen: list[int] = []
        assert cache.request("json", "{}", lambda: seen.append(1))
        assert cache.request("json", "{}", lambda: seen.append(2))  # joins the same compile
        assert cache.outcome("json", "{}") is None
        gate.set()
        deadline = time.monotonic() + 5
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(seen) == [1, 2]
        assert cache.outcome("json", "{}") == "{}"
        assert not cache.request("json", "{}", lambda: seen.append(3))  # known: no callback
    finally:
        cache.shutdown()
