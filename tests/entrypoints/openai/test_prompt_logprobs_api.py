"""Prompt logprobs, API side, on the fake engine (which scores prompt token i at -i/100):
OpenAI's legacy ``echo`` + ``logprobs`` and vLLM's ``prompt_logprobs`` on both endpoints.
That the values equal a forward pass is the engine's test; this checks the shapes and that
the engine's values come through."""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.fake_engine import FakeEngine, make_client, sse_events, wait_healthy


class RecordingEngine(FakeEngine):
    def add_request(self, request_id, prompt, params, prompt_token_ids=None, arrival_time=None):
        self.params = params
        return super().add_request(request_id, prompt, params, prompt_token_ids, arrival_time)


@pytest.fixture(scope="module")
def engine_client():
    engine = RecordingEngine()
    with make_client(engine) as c:
        wait_healthy(c)
        yield engine, c


def test_echo_with_logprobs_scores_the_prompt_first(engine_client):
    engine, client = engine_client
    r = client.post(
        "/v1/completions", json={"prompt": "abcd", "max_tokens": 2, "echo": True, "logprobs": 2}
    ).json()
    assert engine.params.prompt_logprobs == 2 and engine.params.logprobs == 2
    (choice,) = r["choices"]
    lp = choice["logprobs"]
    assert lp["tokens"][:4] == ["a", "b", "c", "d"] and len(lp["tokens"]) == 4 + 2
    assert lp["token_logprobs"][:4] == [None, -0.01, -0.02, -0.03]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {"b": -0.01, chr(999): -5.0}
    assert lp["text_offset"] == [0, 1, 2, 3, 4, 5] and choice["text"] == "abcd" + "".join(
        lp["tokens"][4:]
    )
    assert choice["prompt_logprobs"] is None  # vLLM's null: not asked for
    # logprobs=1: the top one of each prompt position (and the prompt's own token).
    r = client.post(
        "/v1/completions", json={"prompt": "abcd", "max_tokens": 2, "echo": True, "logprobs": 1}
    ).json()
    assert r["choices"][0]["logprobs"]["top_logprobs"][1] == {"b": -0.01}
    # Without echo the prompt is neither returned nor scored.
    r = client.post(
        "/v1/completions", json={"prompt": "abcd", "max_tokens": 2, "logprobs": 1}
    ).json()
    assert engine.params.prompt_logprobs is None and len(r["choices"][0]["logprobs"]["tokens"]) == 2


def test_echo_with_logprobs_streamed_and_per_prompt(engine_client):
    _, client = engine_client
    body = {
        "prompt": ["ab", [120, 121, 122]],
        "max_tokens": 3,
        "n": 2,
        "echo": True,
        "logprobs": 0,
        "seed": 1,
    }
    whole = client.post("/v1/completions", json=body).json()["choices"]
    events, _ = sse_events(client.post("/v1/completions", json={**body, "stream": True}).text)
    tokens: dict[int, list] = {}
    values: dict[int, list] = {}
    for e in events[:-1]:
        (ch,) = json.loads(e)["choices"]
        tokens.setdefault(ch["index"], []).extend(ch["logprobs"]["tokens"])
        values.setdefault(ch["index"], []).extend(ch["logprobs"]["token_logprobs"])
    for c in whole:
        prompt = ["a", "b"] if c["index"] < 2 else ["x", "y", "z"]
        assert (
            c["logprobs"]["tokens"][: len(prompt)] == prompt
            and c["logprobs"]["token_logprobs"][0] is None
        )
        assert (
            tokens[c["index"]] == c["logprobs"]["tokens"]
            and values[c["index"]] == c["logprobs"]["token_logprobs"]
        )


def test_vllm_prompt_logprobs_on_both_endpoints(engine_client):
    engine, client = engine_client
    r = client.post(
        "/v1/completions", json={"prompt": "abc", "max_tokens": 1, "prompt_logprobs": 1}
    ).json()
    assert engine.params.prompt_logprobs == 1
    assert r["choices"][0]["prompt_logprobs"] == [
        None,
        {
            "98": {"logprob": -0.01, "rank": 1, "decoded_token": "b"},
            "999": {"logprob": -5.0, "rank": 2, "decoded_token": chr(999)},
        },
        {
            "99": {"logprob": -0.02, "rank": 1, "decoded_token": "c"},
            "999": {"logprob": -5.0, "rank": 2, "decoded_token": chr(999)},
        },
    ]
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
            "prompt_logprobs": 0,
        },
    ).json()
    lps = r["prompt_logprobs"]
    assert len(lps) == r["usage"]["prompt_tokens"] == len("<user>hi<assistant>") and lps[0] is None
    assert lps[1]["117"]["logprob"] == -0.01  # "u"


def test_prompt_logprobs_are_not_streamed(engine_client):
    _, client = engine_client
    for path, body in (
        ("/v1/completions", {"prompt": "a"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
    ):
        r = client.post(path, json={**body, "prompt_logprobs": 1, "stream": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
