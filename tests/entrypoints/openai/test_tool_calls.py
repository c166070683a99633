"""Tool calling: the Hermes-style parser (whole and streamed), the forcing schemas, the chat
template's tool rendering (native and fallback), and the API on the fake engine with a
scripted model output, through the official ``openai`` client."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from streamkv.entrypoints.openai.chat_messages import ChatMessage, Tool
from streamkv.entrypoints.openai.chat_template import render_chat
from streamkv.entrypoints.openai.tool_calls import (
    HermesStream,
    forced_tool_schema,
    parse_hermes,
    parse_required,
)
from tests.entrypoints.fake_engine import FakeEngine, FakeTokenizer, make_client, wait_healthy

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "current weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SAID = "Let me check. "
USER = [{"role": "user", "content": "Weather in Paris?"}]
KW = {"model": "fake", "max_tokens": 200}


def tools(*specs) -> list[Tool]:
    return [Tool.model_validate(s) for s in specs]


# -- the parser -----------------------------------------------------------------------------
def test_stream_holds_the_call_back_even_one_character_at_a_time():
    stream, sent = HermesStream(), []
    for ch in SAID + CALL:
        sent.append(stream.feed(ch))
    sent.append(stream.finish())
    assert "".join(sent) == SAID and not any("<" in s for s in sent)
    (call,) = stream.calls
    assert call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert stream.new_calls() == [(0, call)] and stream.new_calls() == []


def test_whole_output_parsing():
    content, calls = parse_hermes(SAID + CALL + "\n" + CALL.replace("Paris", "Oslo"))
    assert content == SAID.strip() and [
        json.loads(c["function"]["arguments"])["city"] for c in calls
    ] == ["Paris", "Oslo"]
    assert len({c["id"] for c in calls}) == 2
    assert parse_hermes(CALL + CALL, parallel=False)[1][0]["function"]["name"] == "get_weather"
    assert len(parse_hermes(CALL + CALL, parallel=False)[1]) == 1
    # Not JSON, or not a call: the text stays the model's answer.
    for text in (
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"city": 1}</tool_call>',
        "plain",
        "a <tool_call> b",
    ):
        assert parse_hermes(text) == (text, [])


def test_an_unclosed_last_call_counts_when_its_json_is_whole():
    # The model ended (EOS) before writing </tool_call>.
    content, calls = parse_hermes(SAID + CALL.removesuffix("</tool_call>"))
    assert content == SAID.strip() and json.loads(calls[0]["function"]["arguments"]) == {
        "city": "Paris"
    }
    content, calls = parse_hermes(CALL + CALL.removesuffix("\n</tool_call>"), parallel=True)
    assert content is None and len(calls) == 2
    # Cut off inside its JSON: no call, the text is the answer.
    cut = SAID + CALL[:30]
    assert parse_hermes(cut) == (cut, [])


def test_a_partial_tag_is_held_until_it_is_known():
    stream = HermesStream()
    assert stream.feed("see <tool_") == "see "
    assert stream.feed("tip>") == "<tool_tip>"
    assert stream.feed("x <tool_c") == "x " and stream.finish() == "<tool_c"


def test_forcing_schemas():
    t = tools(WEATHER, TIME)
    assert forced_tool_schema(t, t[0], True) == WEATHER["function"]["parameters"]
    assert forced_tool_schema(t, t[1], True) == {"type": "object", "properties": {}}
    schema = forced_tool_schema(t, None, True)
    good = [
        {"name": "get_weather", "arguments": {"city": "Oslo"}},
        {"name": "get_time", "arguments": {}},
    ]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "get_weather", "arguments": {"town": "x"}}],
        [{"name": "nope", "arguments": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, forced_tool_schema(t, None, parallel=False))
    calls = parse_required(json.dumps(good))
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert parse_required('[{"name": "get_weather", "argu') is None


# -- rendering ------------------------------------------------------------------------------
HISTORY = [
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "9C"},
]


def messages(raw) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in raw]


def test_fallback_rendering_for_a_template_without_tools():
    tok = FakeTokenizer()  # no chat_template: the Hermes-style text fallback
    text = tok.decode(render_chat(tok, messages(HISTORY), True, False, tools(WEATHER)))
    system, rest = text.split("<user>", 1)
    assert (
        system.startswith("<system>")
        and '"name": "get_weather"' in system
        and "<tool_call>" in system
    )
    assert (
        '<assistant><tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call>'
    ) in rest
    # Both tool results in one user turn, so that turns still alternate.
    assert (
        "<user><tool_response>\n18C\n</tool_response>\n<tool_response>\n9C\n</tool_response><assistant>"
        in rest
    )


class RecordingTokenizer(FakeTokenizer):
    chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}{# knows tools #}"

    def apply_chat_template(
        self, messages, tokenize=False, add_generation_prompt=True, tools=None
    ) -> str:
        self.seen = (messages, tools)
        return "rendered"


def test_call_arguments_as_an_object_or_absent_render_as_objects():
    # vLLM takes the arguments object itself too; absent arguments are {}.
    raw = [
        HISTORY[0],
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {"id": "call_2", "type": "function", "function": {"name": "get_time"}},
            ],
        },
        *HISTORY[2:],
    ]
    tok = RecordingTokenizer()
    render_chat(tok, messages(raw), True, False)
    calls = tok.seen[0][1]["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == [{"city": "Paris"}, {}]
    text = FakeTokenizer().decode(render_chat(FakeTokenizer(), messages(raw), True, False))
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert '{"name": "get_time", "arguments": {}}' in text


def test_native_rendering_for_a_template_with_tools():
    tok = RecordingTokenizer()
    render_chat(tok, messages(HISTORY), True, False, tools(WEATHER))
    dicts, offered = tok.seen
    assert offered == [WEATHER]
    call = dicts[1]["tool_calls"][0]
    # Templates read the arguments as an object (Qwen2's: ``tool_call.arguments | tojson``).
    assert call["function"]["arguments"] == {"city": "Paris"} and call["id"] == "call_1"
    assert dicts[2] == {"role": "tool", "content": "18C", "tool_call_id": "call_1"}


# -- the API on the fake engine ---------------------------------------------------------------
class RecordingEngine(FakeEngine):
    def add_request(self, request_id, prompt, params, prompt_token_ids=None, arrival_time=None):
        self.params = params
        return super().add_request(request_id, prompt, params, prompt_token_ids, arrival_time)


@pytest.fixture
def api(request):
    engine = RecordingEngine(step_delay=0.0005, max_model_len=2048, script=request.param)
    with make_client(engine) as http:
        wait_healthy(http)
        with openai.OpenAI(
            base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0
        ) as c:
            yield c, engine


@pytest.mark.parametrize("api", [SAID + CALL], indirect=True)
def test_auto_parses_the_models_tool_call(api):
    client, engine = api
    r = client.chat.completions.create(**KW, messages=USER, tools=[WEATHER])
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == SAID.strip()
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Paris"
    }
    assert engine.params.structured_outputs is None  # auto constrains nothing
    # The history round-trips: the assistant's message and the tool's answer go back in.
    again = client.chat.completions.create(
        **KW,
        tools=[WEATHER],
        messages=[
            *USER,
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "18C"},
        ],
    )
    assert again.choices[0].finish_reason == "tool_calls"
    assert (
        client.chat.completions.create(**KW, messages=USER, tools=[WEATHER], tool_choice="none")
        .choices[0]
        .message.content
        == SAID + CALL
    )


@pytest.mark.parametrize("api", [SAID + CALL.removesuffix("</tool_call>")], indirect=True)
def test_auto_streams_an_unclosed_last_call(api):
    client, _ = api
    chunks = list(client.chat.completions.create(**KW, messages=USER, tools=[WEATHER], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == SAID
    (call,) = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("api", [SAID + CALL], indirect=True)
def test_auto_streams_calls_as_tool_call_deltas(api):
    client, _ = api
    chunks = list(client.chat.completions.create(**KW, messages=USER, tools=[WEATHER], stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    content = "".join(d.content or "" for d in deltas)
    assert content == SAID and "tool_call" not in content
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.startswith("call_")
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [
        "tool_calls"
    ]


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("api", ['{"city": "Paris"}'], indirect=True)
def test_named_choice_forces_the_arguments_schema(api):
    client, engine = api
    r = client.chat.completions.create(
        **KW, messages=USER, tools=[WEATHER, TIME], tool_choice=NAMED
    )
    assert engine.params.structured_outputs.json == WEATHER["function"]["parameters"]
    (choice,) = r.choices
    assert (
        choice.message.content == "" and choice.finish_reason == "stop"
    )  # vLLM's "" beside forced calls
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    chunks = list(
        client.chat.completions.create(
            **KW, messages=USER, tools=[WEATHER], tool_choice=NAMED, stream=True
        )
    )
    calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
    assert calls[0].id and calls[0].function.name == "get_weather"
    assert all(tc.id is None and tc.index == 0 for tc in calls[1:])
    assert "".join(tc.function.arguments for tc in calls) == '{"city": "Paris"}'


@pytest.mark.parametrize("api", ['[{"name": "get_time", "arguments": {}}]'], indirect=True)
def test_required_choice_forces_a_call_list(api):
    client, engine = api
    r = client.chat.completions.create(
        **KW,
        messages=USER,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    schema = engine.params.structured_outputs.json
    assert schema["maxItems"] == 1
    jsonschema.validate(json.loads('[{"name": "get_time", "arguments": {}}]'), schema)
    (choice,) = r.choices
    assert (
        choice.finish_reason == "tool_calls"
        and choice.message.tool_calls[0].function.name == "get_time"
    )
    chunks = list(
        client.chat.completions.create(
            **KW, messages=USER, tools=[WEATHER, TIME], tool_choice="required", stream=True
        )
    )
    calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
    assert [tc.function.name for tc in calls] == ["get_time"] and chunks[-1].choices[
        0
    ].finish_reason == "tool_calls"


# What pydantic writes for a tool whose arguments hold a nested model: "$defs" and "$ref".
NESTED = {
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "$defs": {
                "Place": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                }
            },
            "type": "object",
            "properties": {"to": {"$ref": "#/$defs/Place"}},
            "required": ["to"],
        },
    },
}


def test_required_hoists_each_tools_defs_to_the_root():
    schema = forced_tool_schema(tools(NESTED, TIME), None, True)
    assert schema["$defs"] == NESTED["function"]["parameters"]["$defs"]
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["arguments"]
    jsonschema.validate([{"name": "book", "arguments": {"to": {"city": "Oslo"}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "book", "arguments": {"to": {"town": 1}}}], schema)
    # The same name twice with one meaning is fine; with two meanings, a 400 naming tools.
    forced_tool_schema(tools(NESTED, NESTED), None, True)
    other = json.loads(json.dumps(NESTED).replace('"city"', '"town"'))
    with pytest.raises(Exception) as e:
        forced_tool_schema(tools(NESTED, other), None, True)
    assert getattr(e.value, "param", None) == "tools"


@pytest.mark.parametrize(
    "api", ['[{"name": "book", "arguments": {"to": {"city": "Oslo"}}}]'], indirect=True
)
def test_required_with_defs_is_served(api):
    client, engine = api
    r = client.chat.completions.create(**KW, messages=USER, tools=[NESTED], tool_choice="required")
    assert "$defs" in engine.params.structured_outputs.json
    (call,) = r.choices[0].message.tool_calls
    assert (
        json.loads(call.function.arguments) == {"to": {"city": "Oslo"}}
        and r.choices[0].message.content == ""
    )


@pytest.mark.parametrize("api", ['[{"name": "get_time", "arguments": {}}]'], indirect=True)
def test_a_forced_call_cut_off_by_max_tokens_is_no_call(api):
    client, _ = api
    cut = {**KW, "max_tokens": 5}
    r = client.chat.completions.create(
        **cut, messages=USER, tools=[WEATHER, TIME], tool_choice="required"
    )
    (choice,) = r.choices
    assert (
        choice.finish_reason == "length"
        and not choice.message.tool_calls
        and choice.message.content == ""
    )
    r = client.chat.completions.create(
        **cut, messages=USER, tools=[WEATHER, TIME], tool_choice=NAMED
    )
    (choice,) = r.choices
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    chunks = list(
        client.chat.completions.create(
            **cut, messages=USER, tools=[WEATHER, TIME], tool_choice="required", stream=True
        )
    )
    assert not [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
    assert (
        chunks[-1].choices[0].delta.content == ""
        and chunks[-1].choices[0].finish_reason == "length"
    )
