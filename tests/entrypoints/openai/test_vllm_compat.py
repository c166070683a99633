"""What vLLM users send that OpenAI's own API spells differently or leaves out, on the fake
engine through the official ``openai`` client: OpenAI's legacy scoring call (``echo`` with
``max_tokens: 0``), ``top_k: 0``, ``max_completion_tokens`` beside ``max_tokens``, and the
chat-template fields ``chat_template_kwargs`` and ``continue_final_message``."""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest

from streamkv import __version__
from streamkv.entrypoints.cli.main import build_parser
from streamkv.sampling_params import InvalidParameter
from tests.entrypoints.fake_engine import FakeEngine, make_client, sse_events, wait_healthy


class RecordingEngine(FakeEngine):
    """Keeps the last request's sampling parameters and prompt text."""

    def add_request(self, request_id, prompt, params, prompt_token_ids=None, arrival_time=None):
        self.params, self.prompt = params, self.tokenizer.decode(prompt_token_ids or [])
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


def test_echo_with_max_tokens_0_returns_the_scored_prompt_alone(api):
    client, http, engine = api
    r = client.completions.create(model="fake", prompt="abcd", echo=True, max_tokens=0, logprobs=1)
    assert engine.params.max_tokens == 1 and engine.params.prompt_logprobs == 1
    (choice,) = r.choices
    assert choice.text == "abcd" and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.tokens == list("abcd") and lp.token_logprobs == [None, -0.01, -0.02, -0.03]
    assert lp.text_offset == [0, 1, 2, 3] and len(lp.top_logprobs) == 4
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (4, 0)
    # Streamed: the same, in one chunk per choice, and the usage says no completion tokens.
    body = {
        "prompt": "abcd",
        "echo": True,
        "max_tokens": 0,
        "logprobs": 1,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events, _ = sse_events(http.post("/v1/completions", json=body).text)
    chunks = [json.loads(e) for e in events[:-1]]
    texts = {c["choices"][0]["index"]: c["choices"][0]["text"] for c in chunks if c["choices"]}
    assert texts == {0: "abcd", 1: "abcd"}
    assert all(
        c["choices"][0]["logprobs"]["tokens"] == list("abcd") for c in chunks if c["choices"]
    )
    assert chunks[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 0, "total_tokens": 4}
    # Without logprobs: the prompt comes back as text only.
    r = client.completions.create(model="fake", prompt="xy", echo=True, max_tokens=0)
    assert r.choices[0].text == "xy" and r.choices[0].logprobs is None
    # Without echo, max_tokens 0 asks for nothing at all.
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="fake", prompt="xy", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_top_k_0_means_no_top_k(api):
    client, _, engine = api
    client.completions.create(model="fake", prompt="ab", max_tokens=2, extra_body={"top_k": 0})
    assert engine.params.top_k == -1
    client.completions.create(model="fake", prompt="ab", max_tokens=2, extra_body={"top_k": 5})
    assert engine.params.top_k == 5


def test_max_completion_tokens_wins_over_max_tokens(api):
    client, _, engine = api
    chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
    client.chat.completions.create(**chat, max_tokens=7, max_completion_tokens=3)
    assert engine.params.max_tokens == 3
    client.chat.completions.create(**chat, max_tokens=4)
    assert engine.params.max_tokens == 4


def test_chat_template_kwargs_reach_the_template(api):
    client, _, engine = api
    chat = {"model": "fake", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    client.chat.completions.create(
        **chat, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert engine.prompt == "{enable_thinking=False}<user>hi<assistant>"
    for key in ("tokenize", "add_generation_prompt", "chat_template", "not a name"):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**chat, extra_body={"chat_template_kwargs": {key: True}})
        assert (
            e.value.body["param"] == "chat_template_kwargs" and repr(key) in e.value.body["message"]
        )


def test_continue_final_message(api):
    client, _, engine = api
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    client.chat.completions.create(
        model="fake",
        max_tokens=2,
        messages=messages,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert engine.prompt == "<user>hi<assistant>Hel"  # the turn stays open
    client.chat.completions.create(
        model="fake", max_tokens=2, messages=messages, extra_body={"add_generation_prompt": False}
    )
    assert engine.prompt == "<user>hi<assistant>Hel</>"
    # vLLM's chat echo: the continued turn comes back whole.
    r = client.chat.completions.create(
        model="fake",
        max_tokens=2,
        messages=messages,
        extra_body={"continue_final_message": True, "add_generation_prompt": False, "echo": True},
    )
    text = r.choices[0].message.content
    assert text.startswith("Hel") and len(text) == 5
    chunks = list(
        client.chat.completions.create(
            model="fake",
            max_tokens=2,
            messages=messages,
            stream=True,
            extra_body={
                "continue_final_message": True,
                "add_generation_prompt": False,
                "echo": True,
            },
        )
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks) == text
    )  # the fake is deterministic
    assert chunks[0].choices[0].delta.content == "Hel"
    r = client.chat.completions.create(
        model="fake", max_tokens=2, messages=messages[:1], extra_body={"echo": True}
    )
    assert len(r.choices[0].message.content) == 2  # the last message is the user's: nothing to echo
    with pytest.raises(openai.BadRequestError) as e:  # as vLLM: both at once is a contradiction
        client.chat.completions.create(
            model="fake",
            max_tokens=2,
            messages=messages,
            extra_body={"continue_final_message": True},
        )
    assert e.value.body["param"] == "continue_final_message"


def test_version_after_the_command(capsys):
    for argv in (["--version"], ["serve", "--version"], ["generate", "--version"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(argv)
        assert e.value.code == 0
        assert capsys.readouterr().out.strip() == f"streamkv {__version__}"


def test_vllm_tool_calling_flags():
    parse = build_parser().parse_args
    args = parse(
        ["serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    )  # vLLM's docs' line
    assert args.enable_auto_tool_choice is True and args.tool_call_parser == "hermes"
    assert parse(["serve"]).enable_auto_tool_choice is True
    assert parse(["serve", "--no-enable-auto-tool-choice"]).enable_auto_tool_choice is False
    with pytest.raises(SystemExit):
        parse(["serve", "--tool-call-parser", "mistral"])  # a format this server cannot parse


def test_auto_tool_choice_off_is_a_400_as_in_vllm():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    chat = {
        "model": "fake",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [tool],
    }
    with make_client(FakeEngine(step_delay=0.0005), auto_tool_choice=False) as http:
        wait_healthy(http)
        r = http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
        assert (
            http.post("/v1/chat/completions", json={**chat, "tool_choice": "none"}).status_code
            == 200
        )
        assert http.post("/v1/chat/completions", json={**chat, "tools": None}).status_code == 200


def test_tokenize_renders_messages_as_the_chat_does(api):
    client, http, engine = api
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [tool],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    r = client.chat.completions.create(
        model="fake",
        max_tokens=2,
        messages=body["messages"],
        tools=body["tools"],
        extra_body={"chat_template_kwargs": body["chat_template_kwargs"]},
    )
    t = http.post("/tokenize", json=body).json()
    assert (
        t["count"] == r.usage.prompt_tokens
        and engine.tokenizer.decode(t["tokens"]) == engine.prompt
    )
    assert "{enable_thinking=False}" in engine.prompt and '"name": "f"' in engine.prompt


def test_truncate_prompt_tokens_keeps_the_prompts_end(api):
    client, _, engine = api
    r = client.completions.create(
        model="fake",
        prompt="abcdefgh",
        max_tokens=1,
        echo=True,
        extra_body={"truncate_prompt_tokens": 3},
    )
    assert engine.prompt == "fgh" and r.usage.prompt_tokens == 3
    assert r.choices[0].text.startswith("fgh")  # the echo is the prompt the model saw
    r = client.completions.create(
        model="fake", prompt=[[97, 98, 99]], max_tokens=1, extra_body={"truncate_prompt_tokens": 5}
    )
    assert engine.prompt == "abc" and r.usage.prompt_tokens == 3
    client.completions.create(
        model="fake", prompt="ab" * 200, max_tokens=1, extra_body={"truncate_prompt_tokens": -1}
    )
    assert len(engine.prompt) == 256  # -1: the context length (the fake's is 256)
    r = client.chat.completions.create(
        model="fake",
        max_tokens=1,
        messages=[{"role": "user", "content": "hello"}],
        extra_body={"truncate_prompt_tokens": 4},
    )
    assert (
        engine.prompt == "ant>" and r.usage.prompt_tokens == 4
    )  # the rendered chat's last 4 tokens
    for bad in (0, -2):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(
                model="fake", prompt="ab", max_tokens=1, extra_body={"truncate_prompt_tokens": bad}
            )
        assert e.value.body["param"] == "truncate_prompt_tokens"


def test_cache_salt_and_allowed_token_ids_reach_the_engine(api):
    # The engine honours them (tests/core/test_cache_salt.py, tests/engine/test_sampling_extras.py).
    client, _, engine = api
    extra = {"cache_salt": "tenant-1", "allowed_token_ids": [97, 98]}
    client.completions.create(model="fake", prompt="ab", max_tokens=1, extra_body=extra)
    assert (engine.params.cache_salt, engine.params.allowed_token_ids) == ("tenant-1", [97, 98])
    client.chat.completions.create(
        model="fake",
        max_tokens=1,
        messages=[{"role": "user", "content": "x"}],
        extra_body={"cache_salt": "tenant-2"},
    )
    assert engine.params.cache_salt == "tenant-2" and engine.params.allowed_token_ids is None


def test_return_token_ids(api):
    _, http, engine = api
    body = {"prompt": "abc", "max_tokens": 3, "n": 2, "return_token_ids": True}
    r = http.post("/v1/completions", json=body).json()
    for c in r["choices"]:
        assert c["prompt_token_ids"] == [97, 98, 99] and len(c["token_ids"]) == 3
        assert engine.tokenizer.decode(c["token_ids"]) == c["text"]
    events, _ = sse_events(http.post("/v1/completions", json={**body, "stream": True}).text)
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    for k in (0, 1):
        mine = [c for c in chunks if c["index"] == k]
        assert mine[0]["prompt_token_ids"] == [97, 98, 99] and all(
            "prompt_token_ids" not in c for c in mine[1:]
        )
        assert (
            sum((c["token_ids"] for c in mine), []) == r["choices"][k]["token_ids"]
        )  # the fake is deterministic
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "return_token_ids": True,
    }
    r = http.post("/v1/chat/completions", json=chat).json()
    assert engine.tokenizer.decode(r["prompt_token_ids"]) == "<user>hi<assistant>"
    (choice,) = r["choices"]
    assert engine.tokenizer.decode(choice["token_ids"]) == choice["message"]["content"]
    events, _ = sse_events(http.post("/v1/chat/completions", json={**chat, "stream": True}).text)
    chunks = [json.loads(e) for e in events[:-1]]
    assert (
        chunks[0]["prompt_token_ids"] == r["prompt_token_ids"]
        and "prompt_token_ids" not in chunks[1]
    )
    assert sum((c["choices"][0]["token_ids"] for c in chunks[1:]), []) == choice["token_ids"]
    # Not asked for: null, as vLLM sends them.
    r = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 1}).json()
    assert r["choices"][0]["token_ids"] is None and r["choices"][0]["prompt_token_ids"] is None


class CappedEngine(FakeEngine):
    """Refuses as the real engine's admission does: logprobs over 2, any JSON schema."""

    def add_request(self, request_id, prompt, params, prompt_token_ids=None, arrival_time=None):
        if params.logprobs is not None and params.logprobs > 2:
            raise InvalidParameter(
                "logprobs",
                f"logprobs must be at most the engine's max_logprobs (2), got {params.logprobs}.",
            )
        if params.structured_outputs is not None:
            raise InvalidParameter(
                "structured_outputs", "structured_outputs: the json cannot be compiled: no."
            )
        return super().add_request(request_id, prompt, params, prompt_token_ids, arrival_time)


def test_engine_refusals_name_the_field_as_the_request_spelled_it():
    chat = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    with make_client(CappedEngine(step_delay=0.0005)) as http:
        wait_healthy(http)
        e = http.post(
            "/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 5}
        ).json()["error"]
        assert e["param"] == "top_logprobs" and e["message"].startswith(
            "top_logprobs must be at most"
        )
        e = http.post(
            "/v1/chat/completions", json={**chat, "response_format": {"type": "json_object"}}
        ).json()["error"]
        assert e["param"] == "response_format" and e["message"].startswith(
            "response_format: the json cannot"
        )
        e = http.post(
            "/v1/completions", json={"prompt": "a", "max_tokens": 1, "logprobs": 5}
        ).json()["error"]
        assert e["param"] == "logprobs" and e["message"].startswith("logprobs must be at most")


def test_several_served_model_names(tmp_path):
    parse = build_parser().parse_args
    assert parse(["serve", "m", "--served-model-name", "smol", "gpt-4o"]).served_model_name == [
        "smol",
        "gpt-4o",
    ]
    path = tmp_path / "serve.yaml"
    path.write_text("served-model-name: [smol, gpt-4o]\n")
    from streamkv.entrypoints.cli.main import parse_args

    assert parse_args(build_parser(), ["serve", "--config", str(path)]).served_model_name == [
        "smol",
        "gpt-4o",
    ]
    with make_client(FakeEngine(step_delay=0.0005), model_aliases=("gpt-4o",)) as http:
        wait_healthy(http)
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["fake", "gpt-4o"]
        for name in ("gpt-4o", "fake"):  # either name; the response names the one asked for
            r = http.post("/v1/completions", json={"model": name, "prompt": "a", "max_tokens": 1})
            assert r.status_code == 200 and r.json()["model"] == name
        r = http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "a"}], "max_tokens": 1},
        )
        assert r.json()["model"] == "fake"  # none asked for: the first
        assert (
            http.post("/v1/completions", json={"model": "gpt-5", "prompt": "a"}).status_code == 404
        )


def test_request_id_names_the_request():
    engine = FakeEngine(step_delay=0.05)
    with make_client(engine) as http:
        wait_healthy(http)
        r = http.post(
            "/v1/completions", json={"prompt": "a", "max_tokens": 1, "request_id": "job-7"}
        ).json()
        assert r["id"] == "cmpl-job-7"
        r = http.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "a"}],
                "max_tokens": 1,
                "request_id": "job-7",
            },
        ).json()
        assert r["id"] == "chatcmpl-job-7"
        # The same id twice at once: the second is refused (a 400, not a 500), the first runs on.
        body = {"prompt": "a", "max_tokens": 20, "request_id": "dup"}
        first: list = []
        t = threading.Thread(target=lambda: first.append(http.post("/v1/completions", json=body)))
        t.start()
        deadline = time.monotonic() + 10
        while "cmpl-dup" not in engine.requests and time.monotonic() < deadline:
            time.sleep(0.001)
        r = http.post("/v1/completions", json=body)
        t.join()
        assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"
        assert first[0].status_code == 200
