"""Structured outputs through the API: every spelling maps to one ``StructuredOutputs``
(fast, no model), and on a real server (slow) the outputs parse and validate against their
schema (jsonschema), whole and streamed; forced tool calls validate against the tool's
parameters; echo + logprobs returns one logprob per prompt token."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from streamkv.entrypoints.openai.chat_request import ChatCompletionRequest
from streamkv.entrypoints.openai.errors import APIError
from streamkv.entrypoints.openai.protocol import validate
from streamkv.entrypoints.openai.requests import CompletionRequest
from tests.entrypoints.conftest import run_server

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "hi"}]
OBJ = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def structured(body: dict, cls=ChatCompletionRequest):
    base = {"messages": CHAT} if cls is ChatCompletionRequest else {"prompt": "hi"}
    return validate(cls, {**base, **body}).params().structured_outputs


@pytest.mark.parametrize(
    "body, kind, value",
    [
        ({"response_format": {"type": "json_object"}}, "json_object", True),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "o", "schema": OBJ, "strict": True},
                }
            },
            "json",
            OBJ,
        ),
        ({"structured_outputs": {"json": json.dumps(OBJ)}}, "json", json.dumps(OBJ)),
        ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", ["yes", "no"]),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", 'root ::= "a"'),
        ({"structured_outputs": {"json_object": True}}, "json_object", True),
        ({"guided_json": OBJ}, "json", OBJ),
        ({"guided_regex": "a|b"}, "regex", "a|b"),
        ({"guided_choice": ["x"]}, "choice", ["x"]),
        ({"guided_grammar": 'root ::= "b"'}, "grammar", 'root ::= "b"'),
    ],
)
@pytest.mark.parametrize("cls", [ChatCompletionRequest, CompletionRequest])
def test_every_spelling_maps_to_one_record(body, kind, value, cls):
    so = structured(body, cls)
    assert so.kind == kind and getattr(so, kind) == value


def test_text_format_is_no_constraint():
    assert structured({"response_format": {"type": "text"}}) is None
    assert structured({}) is None


@pytest.mark.parametrize(
    "body, param",
    [
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": 5}, "guided_json"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        (
            {"response_format": {"type": "json_object"}, "use_beam_search": True, "best_of": 2},
            "response_format",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
    ],
)
def test_refusals_name_the_field_the_request_used(body, param):
    with pytest.raises(APIError) as info:
        structured(body)
    assert info.value.param == param, info.value.message


# -- on the real model --------------------------------------------------------------------
SCHEMAS = [
    {
        "type": "object",
        "properties": {"answer": {"type": "boolean"}},
        "required": ["answer"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["color", "count"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "minItems": 1, "maxItems": 3},
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def client():
    with (
        run_server() as s,
        openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=300) as c,
    ):
        yield c


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_schema_outputs_validate(client, stream):
    for i, schema in enumerate(SCHEMAS):
        kw = dict(
            model=MODEL,
            max_tokens=60,
            temperature=0,
            stream=stream,
            messages=[{"role": "user", "content": "Answer in JSON."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": schema},
            },
        )
        r = client.chat.completions.create(**kw)
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [
                c.choices[0].finish_reason
                for c in chunks
                if c.choices and c.choices[0].finish_reason
            ]
        else:
            text, finish = r.choices[0].message.content, [r.choices[0].finish_reason]
        assert finish == ["stop"], (schema, text)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.slow
def test_completions_choice_regex_and_json_object(client):
    r = client.completions.create(
        model=MODEL,
        prompt="Is the sky blue? Answer:",
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(
        model=MODEL, prompt="A number:", max_tokens=8, extra_body={"guided_regex": "[0-9]{3}"}
    )
    assert re.fullmatch("[0-9]{3}", r.choices[0].text), r.choices[0].text
    c = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if c.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(c.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=2, extra_body={"guided_regex": "(unclosed"}
        )
    assert info.value.body["param"] == "guided_regex"


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_tool_calls_validate_against_the_tool(client, choice):
    tool_choice = (
        {"type": "function", "function": {"name": "get_weather"}}
        if choice == "named"
        else "required"
    )
    # One call: left free, the small model goes on adding calls (a longer valid array).
    r = client.chat.completions.create(
        model=MODEL,
        max_tokens=60,
        temperature=0,
        tools=[WEATHER],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        messages=[{"role": "user", "content": "Weather in Paris for 3 days?"}],
    )
    assert r.choices[0].finish_reason == ("stop" if choice == "named" else "tool_calls")
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


@pytest.mark.slow
def test_echo_logprobs_score_every_prompt_token(client):
    r = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=3,
        temperature=0,
        echo=True,
        logprobs=2,
    )
    lp, n = r.choices[0].logprobs, r.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == n + 3 and lp.token_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    assert lp.top_logprobs[0] is None and all(1 <= len(t) <= 3 for t in lp.top_logprobs[1:])
    assert "".join(lp.tokens[:n]) == "The capital of France is" and r.choices[0].text.startswith(
        "The capital"
    )
