"""vLLM's response shapes, extra routes and request rules (issue 28), on the fake engine
through the official ``openai`` client and plain HTTP: fast, no model. The same behaviour on
the real model is test_vllm_conformance.py's."""

from __future__ import annotations

import json

import openai
import pytest

from tests.entrypoints.fake_engine import FakeEngine, make_client, sse_events, wait_healthy

USER = [{"role": "user", "content": "hi"}]


class RecordingEngine(FakeEngine):
    def add_request(self, request_id, prompt, params, prompt_token_ids=None, arrival_time=None):
        self.params, self.prompt_ids = params, list(prompt_token_ids or [])
        return super().add_request(request_id, prompt, params, prompt_token_ids, arrival_time)


@pytest.fixture(scope="module")
def api():
    engine = RecordingEngine(step_delay=0.0005)
    with make_client(engine) as http:
        wait_healthy(http)
        with openai.OpenAI(
            base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0
        ) as c:
            yield c, http, engine


# -- shapes ----------------------------------------------------------------------------------
def test_optional_keys_are_null_as_vllm_sends_them(api):
    _, http, _ = api
    r = http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}).json()
    (c,) = r["choices"]
    assert {
        k: c[k] for k in ("prompt_logprobs", "prompt_token_ids", "token_ids", "stop_reason")
    } == dict.fromkeys(("prompt_logprobs", "prompt_token_ids", "token_ids", "stop_reason"))
    r = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2}).json()
    assert (
        r["prompt_logprobs"] is None
        and r["prompt_token_ids"] is None
        and r["choices"][0]["token_ids"] is None
    )
    msg = r["choices"][0]["message"]
    assert msg["tool_calls"] == [] and msg["reasoning_content"] is None and msg["refusal"] is None


def test_the_last_streamed_chat_chunk_carries_empty_content(api):
    client, _, _ = api
    chunks = list(
        client.chat.completions.create(model="fake", messages=USER, max_tokens=3, stream=True)
    )
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(
        c.choices[0].delta.content for c in chunks
    )  # every delta has content: concatenation works


def test_model_cards_carry_root_parent_and_permission(api):
    client, _, _ = api
    (card,) = client.models.list().data
    assert card.root == "fake" and card.parent is None
    (perm,) = card.permission
    assert perm["object"] == "model_permission" and perm["allow_sampling"] is True


# -- vLLM's extra fields ---------------------------------------------------------------------
def test_minus_one_logprobs_is_the_whole_vocabulary(api):
    client, _, engine = api
    client.completions.create(model="fake", prompt="ab", max_tokens=1, logprobs=-1)
    assert (
        engine.params.logprobs == 1000
    )  # the fake's vocabulary; the engine caps it (--max-logprobs)
    client.chat.completions.create(
        model="fake", messages=USER, max_tokens=1, logprobs=True, top_logprobs=-1
    )
    assert engine.params.logprobs == 1000
    client.completions.create(
        model="fake", prompt="ab", max_tokens=1, extra_body={"prompt_logprobs": -1}
    )
    assert engine.params.prompt_logprobs == 1000
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="fake", prompt="ab", max_tokens=1, logprobs=-2)


def test_return_tokens_as_token_ids(api):
    client, _, _ = api
    r = client.completions.create(
        model="fake",
        prompt="ab",
        max_tokens=2,
        logprobs=1,
        extra_body={"return_tokens_as_token_ids": True},
    )
    lp = r.choices[0].logprobs
    assert all(t.startswith("token_id:") for t in lp.tokens)
    assert [int(t.split(":")[1]) for t in lp.tokens] == [ord(ch) for ch in r.choices[0].text]
    r = client.chat.completions.create(
        model="fake",
        messages=USER,
        max_tokens=2,
        logprobs=True,
        top_logprobs=1,
        extra_body={"return_tokens_as_token_ids": True},
    )
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [
        f"token_id:{ord(ch)}" for ch in r.choices[0].message.content
    ]
    assert content[0].bytes == list(content[0].token.encode())


def test_the_server_flag_makes_token_ids_the_default():
    with make_client(RecordingEngine(step_delay=0.0005), tokens_as_ids=True) as http:
        wait_healthy(http)
        body = {"prompt": "ab", "max_tokens": 1, "logprobs": 0}
        assert (
            http.post("/v1/completions", json=body)
            .json()["choices"][0]["logprobs"]["tokens"][0]
            .startswith("token_id:")
        )
        mine = http.post(
            "/v1/completions", json={**body, "return_tokens_as_token_ids": False}
        ).json()
        assert not mine["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")


def test_truncation_side(api):
    client, _, engine = api
    client.completions.create(
        model="fake", prompt="abcdef", max_tokens=1, extra_body={"truncate_prompt_tokens": 2}
    )
    assert engine.prompt_ids == [ord("e"), ord("f")]
    client.completions.create(
        model="fake",
        prompt="abcdef",
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": 2, "truncation_side": "right"},
    )
    assert engine.prompt_ids == [ord("a"), ord("b")]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model="fake", prompt="ab", max_tokens=1, extra_body={"truncation_side": "middle"}
        )
    assert e.value.body["param"] == "truncation_side"


# -- validation as vLLM's --------------------------------------------------------------------
def test_requests_vllm_serves(api):
    client, _, engine = api
    assert (
        client.completions.create(model="", prompt="ab", max_tokens=1).model == "fake"
    )  # "": the default model
    r = client.chat.completions.create(
        model="fake",
        max_tokens=1,
        messages=[{"role": "user", "content": "x"}, {"role": "observation", "content": "y"}],
    )
    assert (
        r.choices[0].message.role == "assistant"
    )  # a role of the model's own reaches the template


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": []}, "tools"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"cache_salt": "x" * 257}, "cache_salt"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"allowed_token_ids": [1] * 65537}, "allowed_token_ids"),
    ],
)
def test_requests_vllm_refuses(api, extra, param):
    client, _, _ = api
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake", messages=USER, max_tokens=1, extra_body=extra)
    assert e.value.body["param"] == param


def test_a_json_body_sent_as_a_form_is_refused(api):
    _, http, _ = api
    body = json.dumps({"prompt": "ab", "max_tokens": 1})
    r = http.post(
        "/v1/completions",
        content=body,
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_content_type"
    assert (
        http.post("/v1/completions", content=body).status_code == 200
    )  # no content type: read as JSON


# -- routes ----------------------------------------------------------------------------------
def test_ping_and_invocations(api):
    _, http, _ = api
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
    r = http.post("/invocations", json={"messages": USER, "max_tokens": 2}).json()
    assert r["object"] == "chat.completion"
    r = http.post("/invocations", json={"prompt": "ab", "max_tokens": 2}).json()
    assert r["object"] == "text_completion"
    events, _ = sse_events(
        http.post("/invocations", json={"prompt": "ab", "max_tokens": 2, "stream": True}).text
    )
    assert events[-1] == "[DONE]"
    assert http.post("/invocations", json={"input": "ab"}).status_code == 400


def test_chat_batch(api):
    _, http, engine = api
    body = {"messages": [USER, [{"role": "user", "content": "other"}]], "max_tokens": 3}
    r = http.post("/v1/chat/completions/batch", json=body).json()
    assert [c["index"] for c in r["choices"]] == [0, 1] and r["object"] == "chat.completion"
    assert r["usage"]["completion_tokens"] == 6
    openai.types.chat.ChatCompletion.model_validate(r)
    for bad, param in (
        ({"stream": True}, "stream"),
        ({"n": 2}, "n"),
        ({"messages": USER}, "messages"),
        ({"messages": [USER, [{"role": "user"}]]}, "messages[1][0].content"),
    ):
        r = http.post("/v1/chat/completions/batch", json={**body, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_load_and_tokenizer_info(api):
    _, http, _ = api
    assert http.get("/load").json() == {"server_load": 0}
    info = http.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == "FakeTokenizer" and "chat_template" in info
