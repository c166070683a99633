"""The request models on the fake engine (no model): ``param`` from the pydantic error's
location, unknown fields ignored with one warning, inert and refused fields, /openapi.json
and /docs."""

from __future__ import annotations

import logging

import pytest

from streamkv.entrypoints.openai.chat_request import ChatCompletionRequest
from streamkv.entrypoints.openai.errors import APIError
from streamkv.entrypoints.openai.protocol import validate
from streamkv.entrypoints.openai.requests import CompletionRequest
from tests.entrypoints.fake_engine import make_client, wait_healthy

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client():
    with make_client() as c:
        wait_healthy(c)
        yield c


BAD = [
    # (path, body, param)
    ("/v1/completions", {"prompt": "hi", "n": 17}, "n"),
    (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 2.5},
        "max_tokens",
    ),  # coercible types: test_request_types.py
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    (
        "/v1/completions",
        {"prompt": "hi", "stream_options": {"include_usage": 2}, "stream": True},
        "stream_options.include_usage",
    ),
    ("/v1/completions", {"prompt": "hi", "suffix": "!"}, "suffix"),
    ("/v1/completions", {"prompt": [[1, 2], "x", 3]}, "prompt"),
    (
        "/v1/chat/completions",
        {"messages": [CHAT[0], {"role": "user", "content": 5}]},
        "messages[1].content",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        "messages[0].content[0].type",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "tool", "content": "42"}]},
        "messages[0].tool_call_id",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
        "messages[0].tool_calls",
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]},
        "tools[0].function.name",
    ),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "tool_choice": {"type": "function"}},
        "tool_choice.function",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
        },
        "response_format.json_schema.schema",
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "response_format": {"type": "yaml"}},
        "response_format",
    ),
    ("/v1/chat/completions", {"messages": CHAT, "modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"messages": CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"messages": CHAT, "metadata": {"k": 1}}, "metadata.k"),
    (
        "/tokenize",
        {"messages": [{"role": "", "content": "x"}]},
        "messages[0].role",
    ),  # any other role is the template's
    ("/tokenize", {}, "prompt"),
    ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
    ("/detokenize", {"tokens": [10**6]}, "tokens"),
]


@pytest.mark.parametrize("path, body, param", BAD, ids=[p for _, _, p in BAD])
def test_validation_errors_name_the_field(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert param.split("[")[0].split(".")[0] in error["message"]


def test_unknown_fields_are_ignored_with_one_warning(client, caplog):
    body = {
        "messages": [{"role": "user", "content": "hi", "x_note": 1}],
        "max_tokens": 2,
        "frobnicate": True,
        "stream_options": {"include_usage": True, "shiny": 1},
        "stream": True,
    }
    with caplog.at_level(logging.WARNING, logger="streamkv.entrypoints.requests"):
        r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    lines = [
        rec.getMessage() for rec in caplog.records if rec.name == "streamkv.entrypoints.requests"
    ]
    assert lines == [
        "ignored unknown request fields: frobnicate, messages[0].x_note, stream_options.shiny"
    ]


def test_inert_fields_are_accepted_without_a_warning(client, caplog):
    inert = {
        "metadata": {"trace": "t1"},
        "store": False,
        "parallel_tool_calls": True,
        "reasoning_effort": "low",
        "service_tier": "auto",
        "user": "u1",
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        "guided_decoding_backend": "xgrammar",
        "echo": False,
        "continue_final_message": False,
    }
    with caplog.at_level(logging.WARNING, logger="streamkv.entrypoints.requests"):
        r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, **inert})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert not [rec for rec in caplog.records if rec.name == "streamkv.entrypoints.requests"]


def test_null_means_not_given():
    req = validate(
        ChatCompletionRequest,
        {
            "messages": CHAT,
            "max_tokens": None,
            "temperature": None,
            "tools": None,
            "n": None,
            "stop": None,
        },
    )
    params = req.params()
    assert (params.max_tokens, params.temperature, params.n, params.stop) == (None, 1.0, 1, [])
    assert req.tool_mode() == "none"


def test_sampling_ranges_are_sampling_params_checks():
    with pytest.raises(APIError) as info:
        validate(CompletionRequest, {"prompt": "x", "top_p": 0}).params()
    assert info.value.param == "top_p" and "top_p" in info.value.message


def test_openapi_is_generated_from_the_models(client):
    doc = client.get("/openapi.json").json()
    # Every route is listed: test_openapi_routes.py.
    assert doc["openapi"].startswith("3.1") and {"/v1/completions", "/v1/chat/completions"} <= set(
        doc["paths"]
    )
    schemas = doc["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]
    assert chat["required"] == ["messages"]
    for field in (
        "tools",
        "tool_choice",
        "response_format",
        "structured_outputs",
        "prompt_logprobs",
        "metadata",
    ):
        assert field in chat["properties"], field
    assert schemas["CompletionRequest"]["properties"]["n"]["maximum"] == 16
    ref = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"][
        "application/json"
    ]["schema"]
    assert ref == {"$ref": "#/components/schemas/ChatCompletionRequest"}


def test_docs_page_is_self_contained(client):
    r = client.get("/docs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert (
        "ChatCompletionRequest" in page
        and "<code>tool_choice</code>" in page
        and "/v1/completions" in page
    )
    # Nothing is fetched from elsewhere: no script, no external stylesheet or image.
    assert (
        "<script" not in page
        and "http://" not in page
        and "https://" not in page
        and "<link" not in page
    )
    assert r.headers["content-security-policy"].startswith("default-src 'none'")
