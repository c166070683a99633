"""Issue 13, cases 1 and 2, on a real server with the model in a worker process (mp): a worker
killed (SIGKILL) or frozen (SIGSTOP) mid-stream is detected, /health turns 503, the worker is
restarted and the stream continues with the text a fault-free run gives: no error event, no
text lost or repeated. And, without a server, a stop string that straddles the restart point
is found in the spliced stream (engine/recovery.py)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from streamkv.engine.recovery import Resumed, resume
from streamkv.sampling_params import SamplingParams
from streamkv.sequence import CompletionOutput, RequestOutput
from tests.entrypoints.conftest import run_server

BODY = {"prompt": "The history of the sea:", "max_tokens": 40, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    with run_server("--distributed-executor-backend", "mp") as s:
        yield s


def worker_pids(pid: int) -> list[int]:
    """The rank processes among ``pid``'s children."""
    pids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            pids += [int(p) for p in f.read().split()]
    ranks = []
    for p in pids:
        with open(f"/proc/{p}/cmdline", "rb") as f:
            if b"streamkv.executor.rank" in f.read():
                ranks.append(p)
    return ranks


def stream_with_fault(server, fault: signal.Signals) -> tuple[str, list[dict], list[int], float]:
    """Stream BODY, send ``fault`` to the worker after the 5th chunk; the text, the events,
    the /health codes seen meanwhile, and how long the stream stalled at the fault."""
    events, health, stop_polling = [], [], threading.Event()

    def poll() -> None:
        while not stop_polling.is_set():
            try:
                health.append(httpx.get(f"{server.url}/health", timeout=5).status_code)
            except httpx.TransportError:
                health.append(0)
            time.sleep(0.2)

    poller = threading.Thread(target=poll, daemon=True)
    stall, last = 0.0, time.monotonic()
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**BODY, "stream": True}, timeout=300
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            now = time.monotonic()
            stall, last = max(stall, now - last), now
            events.append(line[6:])
            if len(events) == 5:
                (pid,) = worker_pids(server.proc.pid)
                os.kill(pid, fault)
                poller.start()
    stop_polling.set()
    poller.join()
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and not any("error" in c for c in chunks), events[-3:]
    return "".join(c["choices"][0]["text"] for c in chunks), chunks, health, stall


@pytest.mark.slow
@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP])
def test_worker_fault_mid_stream_is_recovered_with_the_same_text(server, fault):
    expected = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=300).json()["choices"][
        0
    ]["text"]
    before = worker_pids(server.proc.pid)
    text, chunks, health, stall = stream_with_fault(server, fault)
    assert text == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert 503 in health and health[-1] == 200  # unhealthy while recovering, healthy after
    assert worker_pids(server.proc.pid) != before  # a new worker process
    # The stall covers detection (at once for SIGKILL, the 5 s heartbeat timeout for SIGSTOP),
    # starting a worker and loading the model again, and recomputing the prompt.
    assert stall < 120
    assert (
        httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=300).json()["choices"][0][
            "text"
        ]
        == expected
    )


# -- stop strings across the restart point (engine/recovery.py, no server) -----------------
class CharTokenizer:
    """One character per token id (ord), enough for the splice's decoding."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


PROMPT_IDS = [ord(c) for c in "Q: "]


def output(
    text: str, shown: str | None = None, finish: str | None = None, stop=None
) -> RequestOutput:
    """A request's cumulative output: ``text``'s tokens, ``shown`` its (held-back) text."""
    c = CompletionOutput(
        0, text if shown is None else shown, [ord(ch) for ch in text], 0.0, None, finish, stop
    )
    return RequestOutput("r", None, PROMPT_IDS, [c], finish is not None)


def resumed(before: str, params: SamplingParams, shown: str) -> Resumed:
    (part,), joiner = resume("r", PROMPT_IDS, params, output(before, shown), CharTokenizer())
    assert part.prompt_token_ids == PROMPT_IDS + [ord(ch) for ch in before]
    assert part.params.max_tokens == params.max_tokens - len(before)
    return joiner


def test_a_stop_string_straddling_the_restart_ends_the_spliced_stream():
    params = SamplingParams(max_tokens=40, stop=["END"])
    # Before the fault the engine had made "the EN" and shown "the " (EN could begin END).
    joiner = resumed("the EN", params, shown="the ")
    assert joiner.parts["r"][1].text == "the EN"  # the whole text, its held-back tail included
    # The resumed request sees only what comes after: no stop of its own yet.
    first, ended = joiner.join(output(""))
    assert first.outputs[0].text == "the " and not first.finished and not ended  # still held back
    hit, ended = joiner.join(output("D", shown="D"))
    c = hit.outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason, hit.finished) == ("the ", "stop", "END", True)
    assert c.token_ids == [ord(ch) for ch in "the END"]
    assert ended == ["r"]  # the caller aborts the resumed request
    assert joiner.join(output("Dx")) == (None, [])  # a later output of it is stale
    with_stop = resumed(
        "the EN",
        SamplingParams(max_tokens=40, stop=["END"], include_stop_str_in_output=True),
        shown="the ",
    )
    assert with_stop.join(output("D"))[0].outputs[0].text == "the END"


def test_stops_that_do_not_straddle_are_left_to_the_engines():
    params = SamplingParams(max_tokens=40, stop=["END", "xyz"])
    joiner = resumed("the E", params, shown="the ")
    # "E" turned out not to begin END: released; a new tail that could begin one is held.
    out, _ = joiner.join(
        output("Nx", shown="Nx")
    )  # "the ENx": neither stop, but "x" may begin "xyz"
    assert out.outputs[0].text == "the EN" and not out.finished
    # The resumed request found a stop wholly after the restart point itself.
    out, ended = joiner.join(output("ach xyz", shown="ach ", finish="stop", stop="xyz"))
    c = out.outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason, out.finished) == (
        "the Each ",
        "stop",
        "xyz",
        True,
    )
    assert ended == []  # it ended in the engine too
    # No stop strings: the text is joined as it is.
    plain = resumed("the EN", SamplingParams(max_tokens=40), shown="the EN")
    assert plain.join(output("D"))[0].outputs[0].text == "the END"


# -- requests of several samples, best_of and beam search across a worker kill ---------------
SAMPLES = {
    "prompt": "The history of the sea:",
    "max_tokens": 30,
    "ignore_eos": True,
    "n": 3,
    "temperature": 1.0,
    "seed": 1234,
    "stream_options": {"include_usage": True},
}
BEST_OF = {
    "prompt": "A lighthouse keeper wrote:",
    "max_tokens": 40,
    "ignore_eos": True,
    "n": 1,
    "best_of": 3,
    "temperature": 1.0,
    "seed": 7,
}
BEAM = {
    "prompt": "The old harbour",
    "max_tokens": 40,
    "ignore_eos": True,
    "n": 2,
    "best_of": 3,
    "use_beam_search": True,
    "temperature": 0,
}


def stream_choices(server, body: dict, kill_after: int | None = None) -> tuple[dict, dict, dict]:
    """Stream ``body``: each choice's text and finish reason, and the usage chunk. With
    ``kill_after``, SIGKILL the worker after that many chunks, first checking that every
    request of this test is running then."""
    texts, finish, usage, n = {}, {}, None, 0
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=300
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            n += 1
            for c in chunk["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                if c.get("finish_reason"):
                    finish[c["index"]] = c["finish_reason"]
            usage = chunk.get("usage") or usage
            if n == kill_after:
                assert server.gauge("num_requests_running") == 3  # this stream, best_of and beams
                (pid,) = worker_pids(server.proc.pid)
                os.kill(pid, signal.SIGKILL)
    return texts, finish, usage


def answer(server, body: dict) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    out = r.json()
    return {
        "choices": [(c["index"], c["text"], c["finish_reason"]) for c in out["choices"]],
        "usage": out["usage"],
    }


@pytest.mark.slow
def test_samples_best_of_and_beam_search_survive_a_worker_kill(server):
    """n = 3 seeded samples streamed, best_of = 3 (n = 1) and beam search, all running when
    the worker is killed: each answers as a fault-free run does (before: 503 engine_restarted)."""
    expected_stream = stream_choices(server, SAMPLES)
    assert len(expected_stream[0]) == 3 and len(set(expected_stream[0].values())) == 3
    expected = {"best_of": answer(server, BEST_OF), "beam": answer(server, BEAM)}
    got: dict = {}
    threads = [
        threading.Thread(target=lambda k=k, b=b: got.__setitem__(k, answer(server, b)))
        for k, b in (("best_of", BEST_OF), ("beam", BEAM))
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while server.gauge("num_requests_running") < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    before = worker_pids(server.proc.pid)
    assert stream_choices(server, SAMPLES, kill_after=5) == expected_stream
    for t in threads:
        t.join(600)
    assert got == expected
    assert worker_pids(server.proc.pid) != before  # the worker was killed and restarted
    server.wait_idle()
