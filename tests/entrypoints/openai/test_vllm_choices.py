"""Where vLLM and OpenAI differ and streamkv keeps OpenAI's way by default, a serve flag gives
vLLM's (docs/api.md "Differences from vLLM"): ``--error-format vllm`` writes the error class
and the integer status into ``type`` / ``code``; ``--no-tools-system-prompt`` leaves the
offered tools out of the prompt of a template that does not render them."""

from __future__ import annotations

import json

import pytest

from streamkv.entrypoints.openai.chat_messages import ChatMessage, Tool
from streamkv.entrypoints.openai.chat_template import render_chat
from streamkv.entrypoints.openai.errors import vllm_error_type
from tests.entrypoints.fake_engine import make_client, wait_healthy


@pytest.mark.parametrize("fmt", ["openai", "vllm"])
def test_error_format(fmt):
    with make_client(error_format=fmt) as c:
        wait_healthy(c)
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": -3})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "max_tokens" and err["message"]
        if fmt == "vllm":
            assert (err["type"], err["code"]) == ("BadRequestError", 400)
        else:
            assert err["type"] == "invalid_request_error" and not isinstance(err["code"], int)
        r = c.post("/v1/completions", json={"prompt": "hi", "model": "no-such-model"})
        assert r.status_code == 404
        assert r.json()["error"]["type"] == (
            "NotFoundError" if fmt == "vllm" else "not_found_error"
        )


def test_vllm_error_type_names():
    assert [vllm_error_type(s) for s in (400, 404, 429, 500, 503)] == [
        "BadRequestError",
        "NotFoundError",
        "TooManyRequestsError",
        "InternalServerError",
        "ServiceUnavailableError",
    ]


class PlainTemplate:
    """A tokenizer whose template ignores ``tools``: the prompt is the messages as JSON."""

    chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    def apply_chat_template(self, dicts, **kwargs):
        return json.dumps(dicts)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_tools_system_prompt_can_be_left_out():
    messages = [ChatMessage(role="user", content="weather?")]
    tools = [
        Tool.model_validate(
            {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
        )
    ]
    tok = PlainTemplate()
    with_tools = "".join(map(chr, render_chat(tok, messages, True, False, tools)))
    without = "".join(map(chr, render_chat(tok, messages, True, False, tools, tools_prompt=False)))
    assert "get_weather" in with_tools and json.loads(with_tools)[0]["role"] == "system"
    assert without == "".join(map(chr, render_chat(tok, messages, True, False, None)))
