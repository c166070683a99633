"""Request types on the fake engine: coerced as vLLM's pydantic models coerce them by
default ("5" is 5, "true" is true), refused as OpenAI refuses them with
--strict-request-types, and shapes no mode can coerce refused in both."""

from __future__ import annotations

import pytest

from streamkv.entrypoints.openai.chat_request import ChatCompletionRequest
from streamkv.entrypoints.openai.errors import APIError
from streamkv.entrypoints.openai.protocol import validate
from streamkv.entrypoints.openai.requests import CompletionRequest
from tests.entrypoints.fake_engine import make_client, wait_healthy

CHAT = [{"role": "user", "content": "hi"}]

# (path, extra body fields, param): vLLM serves these; OpenAI answers 400.
COERCIBLE = [
    ("/v1/chat/completions", {"logprobs": "true"}, "logprobs"),
    ("/v1/completions", {"max_tokens": "5"}, "max_tokens"),
    (
        "/v1/completions",
        {"max_tokens": True},
        "max_tokens",
    ),  # pydantic's lax int takes a bool, as vLLM's
    ("/v1/completions", {"temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"seed": 7.0}, "seed"),
    (
        "/v1/completions",
        {"stream": True, "stream_options": {"include_usage": 1}},
        "stream_options.include_usage",
    ),
]
# Refused whatever the mode: vLLM refuses them too.
NEVER = [
    ("/v1/completions", {"max_tokens": "five"}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {"max_tokens": [5]}, "max_tokens"),
    ("/v1/chat/completions", {"logprobs": "maybe"}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": 2}, "logprobs"),
    ("/v1/completions", {"user": 5}, "user"),  # numbers are not strings in lax mode either
    ("/v1/completions", {"temperature": "inf"}, "temperature"),
]


def _body(path: str, extra: dict) -> dict:
    base = {"messages": CHAT} if path.endswith("chat/completions") else {"prompt": "hi"}
    return {**base, "max_tokens": 2, **extra}


@pytest.fixture(scope="module")
def lax():
    with make_client() as c:
        wait_healthy(c)
        yield c


@pytest.fixture(scope="module")
def strict():
    with make_client(strict_request_types=True) as c:
        wait_healthy(c)
        yield c


@pytest.mark.parametrize("path, extra, param", COERCIBLE, ids=[p for _, _, p in COERCIBLE])
def test_coercible_types_are_served_by_default(lax, path, extra, param):
    r = lax.post(path, json=_body(path, extra))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path, extra, param", COERCIBLE, ids=[p for _, _, p in COERCIBLE])
def test_strict_request_types_refuse_them_by_name(strict, path, extra, param):
    r = strict.post(path, json=_body(path, extra))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("path, extra, param", NEVER, ids=[f"{p}={e[p]!r}" for _, e, p in NEVER])
@pytest.mark.parametrize("mode", ["lax", "strict"])
def test_uncoercible_types_are_refused_in_both_modes(request, mode, path, extra, param):
    r = request.getfixturevalue(mode).post(path, json=_body(path, extra))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_coerced_values_reach_the_request():
    req = validate(
        ChatCompletionRequest,
        _body("/v1/chat/completions", {"logprobs": "true", "max_tokens": "5"}),
    )
    assert req.logprobs is True and req.max_tokens == 5
    req = validate(CompletionRequest, {"prompt": "hi", "echo": "yes", "n": "2"})
    assert req.echo is True and req.n == 2


def test_validate_takes_strictness_explicitly():
    with pytest.raises(APIError) as e:
        validate(CompletionRequest, {"prompt": "hi", "n": "2"}, strict=True)
    assert e.value.param == "n"


def test_the_websocket_follows_the_apps_setting(strict, lax):
    for client, ok in ((lax, True), (strict, False)):
        with client.websocket_connect("/v1/chat/ws") as ws:
            ws.send_json(
                {"type": "chat", "id": "a", "messages": CHAT, "params": {"max_tokens": "2"}}
            )
            kinds = set()
            while not kinds & {"done", "error"}:
                kinds.add(ws.receive_json()["type"])
            assert ("done" in kinds) is ok, kinds
