"""The server reports the engine's admission refusals (core/admission.py) as OpenAI 400s
naming the parameter; it keeps no copy of the rules. A fake engine runs the real admission
function, so this needs no model."""

from __future__ import annotations

import pytest

from streamkv.core.admission import EngineLimits, check_request
from tests.entrypoints.fake_engine import FakeEngine, make_client, wait_healthy

LIMITS = EngineLimits(
    max_model_len=256,
    vocab_size=1000,
    block_size=16,
    num_kv_blocks=16,
    num_swap_blocks=0,
    usable_kv_blocks=16,
    max_num_seqs=8,
    prefix_caching=False,
)


class AdmittingFakeEngine(FakeEngine):
    def add_request(self, request_id, prompt, params, prompt_token_ids=None, arrival_time=None):
        check_request(prompt_token_ids or [], params, LIMITS)
        return super().add_request(request_id, prompt, params, prompt_token_ids, arrival_time)


@pytest.fixture(scope="module")
def client():
    with make_client(AdmittingFakeEngine()) as c:
        wait_healthy(c)
        yield c


CASES = [
    # (path, body, param, code)
    ("/v1/completions", {"prompt": [1000]}, "prompt", None),
    ("/v1/completions", {"prompt": [5] * 300}, "prompt", "context_length_exceeded"),
    (
        "/v1/completions",
        {"prompt": [5] * 200, "max_tokens": 100},
        "max_tokens",
        "context_length_exceeded",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "min_tokens": 250, "max_tokens": None},
        "min_tokens",
        "context_length_exceeded",
    ),
    ("/v1/completions", {"prompt": [5] * 4, "n": 9}, "n", None),
    # 16-block pool: 4 samples of 100 own tokens each cannot fit, one can.
    (
        "/v1/completions",
        {"prompt": [5] * 20, "n": 4, "max_tokens": 100},
        "n",
        "context_length_exceeded",
    ),
    (
        "/v1/completions",
        {"prompt": [5] * 4, "stop_token_ids": [5000], "min_tokens": 1},
        "stop_token_ids",
        None,
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x" * 300}]},
        "messages",
        "context_length_exceeded",
    ),
    # Beam search refuses what it cannot honour rather than ignore it.
    (
        "/v1/completions",
        {"prompt": [5], "use_beam_search": True, "best_of": 2, "temperature": 0, "stop": ["x"]},
        "stop",
        None,
    ),
]


@pytest.mark.parametrize("path, body, param, code", CASES)
def test_admission_refusals_are_400s_naming_the_parameter(client, path, body, param, code):
    r = client.post(path, json={"max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (
        param,
        code,
        "invalid_request_error",
    ), error
    assert (
        client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}).status_code == 200
    )
