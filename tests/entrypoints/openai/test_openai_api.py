"""End to end: a real server subprocess, the official ``openai`` client (max_retries=0)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.entrypoints.conftest import run_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def server():
    # Prefix caching off: an idle server must then have every KV block on the free list
    # (with it on, cached blocks count as free too; the WebSocket module runs that way).
    with run_server("--no-enable-prefix-caching") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120
    ) as c:
        yield c


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_completion_streaming_text_equals_non_streaming_greedy(client):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[
        0
    ].finish_reason
    assert (
        whole.usage.completion_tokens == 8
        and whole.usage.total_tokens == whole.usage.prompt_tokens + 8
    )


def test_chat_streaming_equals_non_streaming_and_usage(client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert whole.usage.completion_tokens == 8


def test_n2_streaming_interleaves_indices_with_one_finish_each(client):
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=6,
            n=2,
            temperature=1.0,
            seed=7,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    finishes, texts = {0: [], 1: []}, {0: "", 1: ""}
    for c in chunks[:-1]:
        (ch,) = c.choices
        texts[ch.index] += ch.text
        if ch.finish_reason is not None:
            finishes[ch.index].append(ch.finish_reason)
    assert finishes == {0: ["length"], 1: ["length"]}
    assert chunks[-1].usage.completion_tokens == 12 and all(texts.values())


def test_logprobs(client):
    r = client.completions.create(
        model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    assert all(x <= 0 for x in lp.token_logprobs) and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    c = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=3, temperature=0, logprobs=True, top_logprobs=3
    )
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(e.top_logprobs) == 3 for e in content)
    # Greedy: the chosen token is the most likely one.
    assert all(e.top_logprobs[0].token == e.token for e in content)


def test_best_of_and_beam_search_return_n_choices(client):
    for extra in (
        {"best_of": 3, "temperature": 1.0, "seed": 3},
        {"use_beam_search": True, "best_of": 3},
    ):
        r = client.completions.create(
            model=MODEL, prompt="The best way to learn is", max_tokens=4, n=2, extra_body=extra
        )
        assert [c.index for c in r.choices] == [0, 1] and all(
            c.finish_reason == "length" for c in r.choices
        )
        assert r.usage.completion_tokens == 8
    beams = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=4,
        n=2,
        extra_body={"use_beam_search": True, "best_of": 2},
    )
    assert (
        len(beams.choices) == 2
        and beams.choices[0].message.content != beams.choices[1].message.content
    )


def test_stop_and_tokenize_roundtrip(server, client):
    r = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 7"]
    )
    assert r.choices[0].finish_reason == "stop" and " 7" not in r.choices[0].text
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] == 1024
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert text == "Hello world"


def test_identical_concurrent_greedy_requests_match(server):
    async def main():
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120
        ) as c:
            rs = await asyncio.gather(
                *(
                    c.completions.create(
                        model=MODEL, prompt="My favourite food is", max_tokens=8, temperature=0
                    )
                    for _ in range(4)
                )
            )
        return [r.choices[0].text for r in rs]

    texts = asyncio.run(main())
    assert len(set(texts)) == 1 and texts[0]


TOO_LONG = "hello " * 1100
BAD_COMPLETIONS = [
    (dict(prompt="hi", temperature=-1), openai.BadRequestError, "temperature"),
    (dict(prompt="hi", top_p=1.5), openai.BadRequestError, "top_p"),
    (dict(prompt="hi", max_tokens=0), openai.BadRequestError, "max_tokens"),
    (dict(prompt="hi", n=1000), openai.BadRequestError, "n"),
    (dict(prompt="hi", best_of=1000), openai.BadRequestError, "best_of"),
    (dict(prompt="hi", logprobs=1000), openai.BadRequestError, "logprobs"),
    (dict(prompt=""), openai.BadRequestError, "prompt"),
    (dict(prompt=[]), openai.BadRequestError, "prompt"),
    (dict(prompt=[10**9]), openai.BadRequestError, "prompt"),
    (dict(prompt=TOO_LONG), openai.BadRequestError, "prompt"),
    (dict(prompt="hi", max_tokens=5000), openai.BadRequestError, "max_tokens"),
    (dict(prompt="hi", stop=[""]), openai.BadRequestError, "stop"),
    (dict(prompt="hi", seed=2**70), openai.BadRequestError, "seed"),
    (dict(prompt="hi", n=2, best_of=3, stream=True), openai.BadRequestError, "best_of"),
    (
        dict(prompt="hi", stream=True, extra_body={"use_beam_search": True, "best_of": 2}),
        openai.BadRequestError,
        "use_beam_search",
    ),
    (
        dict(prompt="hi", extra_body={"top_k": -2}),
        openai.BadRequestError,
        "top_k",
    ),  # 0 and -1: off (vLLM)
    (
        dict(prompt="hi", suffix="!"),
        openai.BadRequestError,
        "suffix",
    ),  # known, would change the output
    (dict(prompt="hi", extra_body={"max_tokens": "ten"}), openai.BadRequestError, "max_tokens"),
    # Token ids past the vocabulary would index the logits: refused, the server lives on.
    (
        dict(prompt="hi", extra_body={"stop_token_ids": [10**6], "min_tokens": 2}),
        openai.BadRequestError,
        "stop_token_ids",
    ),
    (dict(prompt="hi", logit_bias={"1000000": 5}), openai.BadRequestError, "logit_bias"),
    (dict(prompt="hi", logit_bias={"12": 101}), openai.BadRequestError, "logit_bias"),
    (dict(prompt="hi", logit_bias={"twelve": 1}), openai.BadRequestError, "logit_bias"),
]


def test_logit_bias_forces_and_bans_tokens(server, client):
    prompt = "1, 2, 3,"
    # A large positive bias on one token makes greedy decoding repeat it.
    forced = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logit_bias={"42": 100}
    )
    want = httpx.post(f"{server.url}/detokenize", json={"tokens": [42, 42, 42]}).json()["prompt"]
    assert forced.choices[0].text == want
    # -100 on the token greedy decoding chooses first bans it.
    base = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=0
    )
    first = base.choices[0].logprobs.tokens[0]
    first_id = httpx.post(
        f"{server.url}/tokenize", json={"prompt": first, "add_special_tokens": False}
    ).json()["tokens"]
    assert len(first_id) == 1
    again = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=1,
        temperature=0,
        logprobs=0,
        logit_bias={str(first_id[0]): -100},
    )
    assert again.choices[0].logprobs.tokens[0] != first


@pytest.mark.parametrize(
    "kwargs,error,param", BAD_COMPLETIONS, ids=[p for _, _, p in BAD_COMPLETIONS]
)
def test_bad_completion_requests(client, kwargs, error, param):
    kwargs = {"model": MODEL, "max_tokens": 4, **kwargs}
    with pytest.raises(error) as info:
        r = client.completions.create(**kwargs)
        if kwargs.get("stream"):
            list(r)
    assert info.value.body["param"] == param, info.value.body
    assert (
        client.completions.create(model=MODEL, prompt="ok", max_tokens=1).usage.completion_tokens
        == 1
    )


def test_bad_chat_requests_and_unknown_model(client):
    cases = [
        (dict(messages=[]), openai.BadRequestError),
        (
            dict(messages=[{"role": "", "content": "x"}]),
            openai.BadRequestError,
        ),  # other roles reach the template
        (dict(messages=[{"role": "user"}]), openai.BadRequestError),
        (
            dict(
                messages=[
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            ),
            openai.BadRequestError,
        ),
        (dict(messages=CHAT, top_logprobs=5), openai.BadRequestError),
        (dict(messages=CHAT, logprobs=True, top_logprobs=99), openai.BadRequestError),
        (
            dict(
                messages=CHAT,
                tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice={"type": "function", "function": {"name": "g"}},
            ),
            openai.BadRequestError,
        ),
        (dict(messages=[{"role": "user", "content": TOO_LONG}]), openai.BadRequestError),
        (dict(messages=CHAT, model="gpt-9"), openai.NotFoundError),
    ]
    for kwargs, error in cases:
        with pytest.raises(error):
            client.chat.completions.create(**{"model": MODEL, "max_tokens": 4, **kwargs})
        assert (
            client.completions.create(
                model=MODEL, prompt="ok", max_tokens=1
            ).usage.completion_tokens
            == 1
        )


def test_unknown_fields_are_ignored_and_logged_once(server, client):
    r = client.completions.create(
        model=MODEL,
        prompt="hi",
        max_tokens=2,
        extra_body={"frobnicate_once": 1, "metadata": {"run": "t"}, "store": False},
    )
    assert r.usage.completion_tokens == 2
    lines = [line for line in server.log().splitlines() if "frobnicate_once" in line]
    assert len(lines) == 1 and lines[0].endswith(
        "ignored unknown request fields: frobnicate_once"
    ), lines


def test_raw_bad_bodies(server):
    url = f"{server.url}/v1/completions"
    cases = [
        (b'{"prompt": "hi", ', 400),
        (b'{"prompt": "\xff\xfe"}', 400),
        (b'{"prompt": "\\udc00"}', 400),
        (b'"just a string"', 400),
        (b'{"prompt": "a", "max_tokens": 2, "pad": "' + b"x" * (3 * 2**20) + b'"}', 413),
    ]
    for body, status in cases:
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == status, (body[:40], r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert "Traceback" not in r.text
    # A request head over --max-header-bytes is refused (an error status or a dropped
    # connection), never served.
    try:
        r = httpx.get(f"{server.url}/health", headers={"x-filler": "y" * 64 * 1024}, timeout=30)
        assert r.status_code >= 400
    except httpx.TransportError:
        pass
    assert httpx.post(url, json={"prompt": "ok", "max_tokens": 2}, timeout=60).status_code == 200


def test_no_blocks_leak_after_all_of_the_above(server):
    server.wait_idle(timeout=20)


def test_disconnect_storm_frees_everything(server):
    """50 streaming requests dropped mid-stream (plus some dropped before their first byte
    and some non-streaming ones): within seconds nothing runs or waits and every KV block
    is free; a fresh request then completes."""

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {
            "prompt": f"Request {i}: count to one hundred.",
            "max_tokens": 300,
            "ignore_eos": True,
            "temperature": 0.8,
            "stream": True,
        }
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return  # one token received: leave mid-stream

    async def early(client: httpx.AsyncClient, i: int, stream: bool) -> None:
        """Gone after 0.3 s, before (or just after) its first token; half of them are not
        streaming, so the server learns of it from the receive channel alone."""
        body = {"prompt": f"Early {i}", "max_tokens": 300, "ignore_eos": True, "stream": stream}
        with pytest.raises((asyncio.TimeoutError, httpx.TimeoutException)):
            await asyncio.wait_for(client.post("/v1/completions", json=body), 0.3)

    async def main():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            await asyncio.gather(
                *(one(client, i) for i in range(50)),
                *(early(client, i, i % 2 == 0) for i in range(6)),
            )

    asyncio.run(main())
    server.wait_idle(timeout=15)
    m = server.metrics()
    assert (
        m[
            'vllm:request_success_total{engine="0",finished_reason="abort",model_name="SmolLM2-135M-Instruct"}'
        ]
        >= 50
    )
    r = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "Fresh", "max_tokens": 4}, timeout=60
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    server.wait_idle(timeout=10)
