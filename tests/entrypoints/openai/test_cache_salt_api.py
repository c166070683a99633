"""cache_salt and allowed_token_ids against a real ``streamkv serve`` (the embedded model, CPU):
a prompt sent again finds its prefix-cache blocks only under the same salt (vLLM's isolation
of tenants, issue 26), and only allowed tokens come back (issue 28)."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.entrypoints.conftest import run_server

pytestmark = pytest.mark.slow

PROMPT = " ".join(f"item {i} of a long shared system prompt;" for i in range(20))


@pytest.fixture(scope="module")
def server():
    with run_server() as s:
        yield s


def _hits(server) -> float:
    return server.gauge("prefix_cache_hits_total")


def _new_hits(server, **extra) -> float:
    """Prefix-cache hits, in tokens, of one completion of PROMPT with ``extra`` fields."""
    before = _hits(server)
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 1, **extra},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    server.wait_idle()
    deadline = time.monotonic() + 5  # the metrics read the engine's stats a moment later
    while (after := _hits(server)) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    return after - before


def test_prefix_cache_hits_only_under_the_same_salt(server):
    assert _new_hits(server, cache_salt="tenant-a") == 0
    assert _new_hits(server, cache_salt="tenant-b") == 0
    assert _new_hits(server) == 0
    assert _new_hits(server, cache_salt="tenant-a") > 0
    assert _new_hits(server, cache_salt="tenant-b") > 0
    assert _new_hits(server) > 0


def test_chat_takes_a_salt_and_an_empty_one_is_refused(server):
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1}
    r = httpx.post(
        f"{server.url}/v1/chat/completions", json={**body, "cache_salt": "tenant-c"}, timeout=120
    )
    assert r.status_code == 200, r.text
    r = httpx.post(
        f"{server.url}/v1/chat/completions", json={**body, "cache_salt": ""}, timeout=120
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_only_allowed_tokens_come_back(server):
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": " yes no maybe"}, timeout=30).json()[
        "tokens"
    ]
    for temperature in (0.0, 1.0):
        r = httpx.post(
            f"{server.url}/v1/completions",
            timeout=120,
            json={
                "prompt": "Answer:",
                "max_tokens": 12,
                "temperature": temperature,
                "seed": 3,
                "ignore_eos": True,
                "allowed_token_ids": ids,
                "return_token_ids": True,
            },
        )
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["token_ids"]
        assert len(got) == 12 and set(got) <= set(ids)
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "a", "allowed_token_ids": [10**9]},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids"
