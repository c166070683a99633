"""The engine core in a process of its own (engine/engine_process.py) behind the real app,
with the embedded model on the CPU: the same tokens as the offline engine, streams and
aborts that free their blocks, the engine's verdicts and calls across the process line, and
a dead engine process reported instead of hanging the server."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from starlette.testclient import TestClient

from streamkv.engine.async_engine import AsyncEngine
from streamkv.engine.engine_process import EngineProcess, EngineSpec
from streamkv.entrypoints.kv_view import snapshot_of
from streamkv.entrypoints.llm import LLM, engine_config
from streamkv.entrypoints.security import HostPolicy
from streamkv.entrypoints.server import ServerConfig, build_app
from streamkv.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # the embedded model in a child process: tens of seconds on a loaded CPU

PROMPT = "The capital of France is"
ENGINE = dict(device="cpu", block_size=16, num_kv_blocks=96, num_swap_blocks=0, max_model_len=512)


def _app():
    engine = AsyncEngine(EngineSpec(engine_config(None, **ENGINE)))
    return engine, build_app(engine, ServerConfig(model_name="m", hosts=HostPolicy.build("testserver"), web_dir=None))


def _wait_healthy(c: TestClient) -> None:
    for _ in range(2400):
        if c.get("/health").status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError("the engine did not start")


@pytest.fixture(scope="module")
def client():
    engine, app = _app()
    with TestClient(app) as c:
        _wait_healthy(c)
        assert isinstance(engine._thread, EngineProcess) and engine.engine is None
        yield c, engine


def _wait_free(engine: AsyncEngine, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.stats.get("num_running", 1) or engine.stats.get("num_waiting", 1):
        assert time.monotonic() < deadline, engine.stats
        time.sleep(0.05)


def _stream_text(c: TestClient, **body) -> tuple[str, list[str]]:
    text, finish = "", []
    with c.stream("POST", "/v1/completions", json={"model": "m", "prompt": PROMPT, "stream": True, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                text += chunk["choices"][0]["text"]
                finish.append(chunk["choices"][0]["finish_reason"])
    return text, finish


def test_streams_the_offline_engines_tokens(client):
    c, _ = client
    text, finish = _stream_text(c, max_tokens=24, temperature=0)
    llm = LLM(**ENGINE)
    try:
        want = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0].outputs[0].text
    finally:
        llm.shutdown()
    assert text == want and finish[-1] == "length"
    whole = c.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 24, "temperature": 0})
    assert whole.status_code == 200 and whole.json()["choices"][0]["text"] == want


def test_abort_and_many_streams_free_their_blocks(client):
    c, engine = client
    with c.stream("POST", "/v1/completions", json={"model": "m", "prompt": PROMPT, "stream": True,
                                                   "max_tokens": 400, "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first chunk: the request is aborted
    n = c.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 8, "n": 3, "seed": 1,
                                        "temperature": 1.0})
    assert n.status_code == 200 and len(n.json()["choices"]) == 3
    _wait_free(engine)
    snap, seconds = c.portal.call(engine.run_on_engine, snapshot_of, 10.0)
    assert seconds >= 0 and not snap["requests"]


def test_engine_verdicts_and_call_errors_cross_back(client):
    c, engine = client
    # max_tokens past the context: the engine refuses it, the refusal comes back as a 400.
    r = c.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 100_000})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(Exception, match="pickle|Pickl|attribute"):
        c.portal.call(engine.run_on_engine, lambda e: 1, 5.0)
    assert _stream_text(c, max_tokens=4, temperature=0)[1][-1] == "length"  # still serving


def test_a_dead_engine_process_is_reported():
    engine, app = _app()
    with TestClient(app) as c:
        _wait_healthy(c)
        os.kill(engine._thread._proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while engine.dead is None:
            assert time.monotonic() < deadline, "the engine process's death went unnoticed"
            time.sleep(0.05)
        assert "exited" in str(engine.dead)
        r = c.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_output_deltas_rebuild_every_output():
    """The child's rows rebuild, on the server, exactly the outputs the engine made: growing
    choices as deltas, a choice that shrank or changed index (a beam, a resumed request)
    whole, finished requests forgotten on both ends."""
    from streamkv.engine.engine_process import OutputDeltas
    from streamkv.sequence import CompletionOutput, Logprob, RequestOutput

    def out(rid, choices, finished=False):
        return RequestOutput(rid, "p", [1, 2], [CompletionOutput(i, t, list(ids), -0.5 * len(ids),
                                                                 [{x: Logprob(-0.1)} for x in ids], f)
                                                for i, t, ids, f in choices], finished, metrics={"t": 1.0})

    steps = [
        [out("a", [(0, "He", [5], None)]), out("b", [(0, "x", [9], None), (1, "y", [8], None)])],
        [out("a", [(0, "Hello", [5, 6], None)]), out("b", [(0, "xz", [9, 4], None), (1, "yy", [8, 8], None)])],
        # b's beams swap places and one shrinks: those choices go whole
        [out("a", [(0, "Hello w", [5, 6, 7], None)]), out("b", [(1, "yyq", [8, 8, 3], None), (0, "x", [9], None)])],
        [out("a", [(0, "Hello wo", [5, 6, 7, 2], "stop")], finished=True)],
    ]
    child, server = OutputDeltas(), OutputDeltas()
    for outs in steps:
        rows = child.encode(outs)
        got = server.decode(rows)
        assert [(o.request_id, o.finished, [(c.index, c.text, list(c.token_ids), len(c.logprobs), c.finish_reason)
                                            for c in o.outputs]) for o in got] == \
               [(o.request_id, o.finished, [(c.index, c.text, c.token_ids, len(c.logprobs), c.finish_reason)
                                            for c in o.outputs]) for o in outs]
        assert all(o.prompt_token_ids == [1, 2] and o.metrics == {"t": 1.0} for o in got)
    assert set(child._last) == set(server._last) == {"b"}  # "a" finished: forgotten on both ends
    # after the first step each growing choice crossed as a delta, not whole
    rows = child.encode([out("b", [(1, "yyqq", [8, 8, 3, 3], None), (0, "xk", [9, 1], None)])])
    assert all(isinstance(c, tuple) for c in rows[0][4])


def test_a_worker_killed_mid_stream_resumes_through_the_engine_process():
    """The restart hand-over across the process line: the child restarts the worker, the
    server re-queues the stream (add_first, then handed), its deltas start again whole."""
    import httpx

    from tests.entrypoints.conftest import run_server
    from tests.entrypoints.test_worker_recovery import BODY, stream_with_fault, worker_pids

    with run_server("--distributed-executor-backend", "mp", "--engine-process") as server:
        expected = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=300).json()["choices"][0]["text"]
        before = worker_pids(server.proc.pid)
        text, chunks, health, _ = stream_with_fault(server, signal.SIGKILL)
        assert text == expected and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert 503 in health and health[-1] == 200 and worker_pids(server.proc.pid) != before
        server.wait_idle()
