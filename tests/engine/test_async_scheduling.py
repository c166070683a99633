"""Async scheduling (engine/step_pipeline.py): with the next step scheduled and submitted
before this one's outputs are read, outputs stay token-identical to the synchronous engine
in every configuration, steps really overlap, and nothing leaks."""

from __future__ import annotations

import pytest

from streamkv import LLM, BeamSearchParams, SamplingParams
from streamkv.engine.llm_engine import LLMEngine
from streamkv.entrypoints.llm import engine_config
from streamkv.executor.base import Executor
from streamkv.messages import PENDING_TOKEN, SampleResult, StepInput, StepOutput

PROMPTS = [
    [5, 17, 300, 2, 9, 44, 81, 123, 7, 3, 600, 12, 18],
    [900, 14, 2, 2, 41],
    [
        5,
        17,
        300,
        2,
        9,
        44,
        81,
        123,
        7,
        3,
        600,
        12,
        18,
        77,
        64,
        31,
        8,
        1,
        250,
        19,
    ],  # shares a prefix
    [
        70,
        71,
        72,
        73,
        74,
        75,
        76,
        77,
        78,
        79,
        80,
        81,
        82,
        83,
        84,
        85,
        86,
        87,
        88,
        89,
        90,
        91,
        92,
        93,
        94,
    ],
]


def _engines(tiny_llama_dir, **kwargs):
    base = dict(device="cpu", max_model_len=128, num_swap_blocks=0, block_size=4)
    base.update(kwargs)
    return (
        LLM(str(tiny_llama_dir), async_scheduling=True, **base),
        LLM(str(tiny_llama_dir), async_scheduling=False, **base),
    )


def _run(llm: LLM, params, prompts=PROMPTS):
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    llm.engine.block_manager.check_no_leaks()
    assert not llm.engine.has_unfinished_requests()
    return [[(c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def _same(tiny_llama_dir, params, prompts=PROMPTS, overlaps=True, **kwargs):
    on, off = _engines(tiny_llama_dir, **kwargs)
    try:
        assert on.engine.async_scheduling and not off.engine.async_scheduling
        got, want = _run(on, params, prompts), _run(off, params, prompts)
        assert got == want
        assert off.engine.overlapped_steps == 0
        assert (on.engine.overlapped_steps > 0) == overlaps
        return got, on.engine.stats()
    finally:
        on.shutdown()
        off.shutdown()


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_greedy_max_tokens(tiny_llama_dir):
    got, _ = _same(tiny_llama_dir, GREEDY, num_kv_blocks=256)
    assert all(len(o[0][0]) == 12 and o[0][1] == "length" for o in got)


def test_eos_and_stop_token_ids(tiny_llama_dir):
    # Learn a token each prompt produces mid-way, then stop on it (an EOS-like stop that the
    # engine cannot predict: the step after it was already running).
    _, off = _engines(tiny_llama_dir, num_kv_blocks=256)
    free = [o[0][0] for o in _run(off, GREEDY)]
    off.shutdown()
    params = [
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[toks[4]]) for toks in free
    ]
    got, _ = _same(tiny_llama_dir, params, num_kv_blocks=256)
    assert any(o[0][1] == "stop" and len(o[0][0]) <= 5 for o in got)


@pytest.mark.slow
def test_stop_strings(tiny_llama_dir):
    # The tiny model has no tokenizer: stop strings need text. Use the embedded model.
    pytest.importorskip("transformers")
    kw = dict(device="cpu", num_kv_blocks=256, num_swap_blocks=0, max_model_len=256)
    on, off = LLM(async_scheduling=True, **kw), LLM(async_scheduling=False, **kw)
    try:
        prompts = ["The capital of France is", "One, two, three,"]
        free = off.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
        stops = [o.outputs[0].text.strip().split()[1] for o in free]
        params = [SamplingParams(temperature=0, max_tokens=16, stop=[s]) for s in stops]
        got = [o.outputs[0] for o in on.generate(prompts, params)]
        want = [o.outputs[0] for o in off.generate(prompts, params)]
        assert [(c.text, c.token_ids, c.finish_reason) for c in got] == [
            (c.text, c.token_ids, c.finish_reason) for c in want
        ]
        assert all(c.finish_reason == "stop" for c in got)
        assert on.engine.overlapped_steps > 0
    finally:
        on.shutdown()
        off.shutdown()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(tiny_llama_dir, mode):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    _, stats = _same(
        tiny_llama_dir,
        params,
        num_kv_blocks=40,
        preemption_mode=mode,
        num_swap_blocks=64 if mode == "swap" else 0,
        enable_prefix_caching=False,
    )
    assert stats["num_preemptions"] > 0


def test_prefix_cache_hits(tiny_llama_dir):
    # Twice the same batch: the second run's prompts hit the blocks the first one cached,
    # including blocks completed by decode steps whose tokens were pending when planned.
    on, off = _engines(tiny_llama_dir, num_kv_blocks=256, enable_prefix_caching=True)
    try:
        first = _run(on, GREEDY)
        again = PROMPTS + [p + list(o[0][0][:8]) for p, o in zip(PROMPTS, first)]
        got, want = _run(on, GREEDY, again), _run(off, GREEDY, again)
        assert got == want
        assert on.engine.block_manager.prefix_cache_hits > 0
    finally:
        on.shutdown()
        off.shutdown()


@pytest.mark.parametrize("budget", [16, 64])
def test_chunked_prefill(tiny_llama_dir, budget):
    _same(tiny_llama_dir, GREEDY, num_kv_blocks=256, max_num_batched_tokens=budget, max_num_seqs=4)


def test_parallel_samples_and_beam_search(tiny_llama_dir):
    on, off = _engines(tiny_llama_dir, num_kv_blocks=256)
    try:
        n = SamplingParams(n=3, best_of=4, temperature=0.8, seed=5, max_tokens=10, ignore_eos=True)
        assert _run(on, n) == _run(off, n)
        beams = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
        got, want = (
            [[c.token_ids for c in o.outputs] for o in llm.beam_search(PROMPTS[:2], beams)]
            for llm in (on, off)
        )
        assert got == want and len(got[0]) == 3
        on.engine.block_manager.check_no_leaks()
    finally:
        on.shutdown()
        off.shutdown()


def test_penalties_and_seeded_sampling(tiny_llama_dir):
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=14,
            ignore_eos=True,
            presence_penalty=0.8,
            frequency_penalty=0.5,
            repetition_penalty=1.3,
        ),
        SamplingParams(temperature=1.0, seed=11, max_tokens=14, ignore_eos=True, top_k=20),
        SamplingParams(
            temperature=0.9,
            seed=12,
            max_tokens=14,
            ignore_eos=True,
            top_p=0.8,
            repetition_penalty=1.2,
            logprobs=2,
        ),
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, min_tokens=6),
    ]
    got, _ = _same(tiny_llama_dir, params, num_kv_blocks=256)
    plain, _ = _same(tiny_llama_dir, GREEDY, num_kv_blocks=256)
    assert got[0] != plain[0]  # the penalties did something


def test_abort_mid_flight(tiny_llama_dir):
    on, off = _engines(tiny_llama_dir, num_kv_blocks=256)
    try:
        seen_by = []
        for llm in (on, off):
            engine = llm.engine
            for i, p in enumerate(PROMPTS):
                engine.add_request(str(i), None, GREEDY, prompt_token_ids=p)
            seen: dict[str, list[int]] = {}
            for _ in range(3):
                for out in engine.step():
                    seen[out.request_id] = out.outputs[0].token_ids
            gone = engine.abort_request("1")  # with async, a step holding it is running now
            assert gone is not None and gone.finished
            while engine.has_unfinished_requests():
                for out in engine.step():
                    assert out.request_id != "1"
                    seen[out.request_id] = out.outputs[0].token_ids
            engine.block_manager.check_no_leaks()
            seen_by.append(seen)
        # The aborted request's last output seen may be a step behind: with async scheduling a
        # step's outputs are built in the next call, and none is built once it is aborted.
        got, want = seen_by[0].pop("1"), seen_by[1].pop("1")
        assert got and want[: len(got)] == got and len(want) - len(got) <= 1
        assert seen_by[0] == seen_by[1]
    finally:
        on.shutdown()
        off.shutdown()


def test_max_model_len_ends_without_an_extra_step(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    got, _ = _same(tiny_llama_dir, params, num_kv_blocks=256, max_model_len=40)
    assert all(len(p) + len(o[0][0]) == 40 for p, o in zip(PROMPTS, got))


def test_flag_off_is_the_synchronous_engine(tiny_llama_dir):
    llm = LLM(
        str(tiny_llama_dir),
        device="cpu",
        num_kv_blocks=64,
        num_swap_blocks=0,
        async_scheduling=False,
    )
    try:
        engine = llm.engine
        engine.add_request("a", None, GREEDY, prompt_token_ids=PROMPTS[0])
        engine.step()
        assert engine.pipeline is None and engine.overlapped_steps == 0
    finally:
        llm.shutdown()


class _RecordingExecutor(Executor):
    """No model: each sample is a token drawn from the sequence id and position. It records
    the order of submits and result reads, and checks that a pending input token is one it
    sampled in the step just before."""

    resolves_pending_tokens = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.inputs: list[StepInput] = []
        self.last: set[int] = set()

    def num_available_blocks(self) -> tuple[int, int]:
        return 256, 0

    def init_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        pass

    def execute(self, step: StepInput) -> StepOutput:
        for s in step.seqs:
            assert s.token_ids[0] != PENDING_TOKEN or s.seq_id in self.last
        out = StepOutput(
            {
                s.seq_id: SampleResult([1000 + (7 * s.seq_id + s.start_pos) % 500], [-1.0])
                for s in step.seqs
                if s.sample
            }
        )
        self.last = set(out.results)
        return out

    def submit(self, step: StepInput):
        n = len(self.inputs)
        self.inputs.append(step)
        self.calls.append(("submit", n))
        out = self.execute(step)
        executor = self

        class Handle:
            def result(self) -> StepOutput:
                executor.calls.append(("result", n))
                return out

        return Handle()


@pytest.mark.parametrize("on", [True, False])
def test_the_next_step_is_submitted_before_this_ones_result_is_read(on):
    executor = _RecordingExecutor()
    engine = LLMEngine(
        engine_config(
            None, device="cpu", num_kv_blocks=256, num_swap_blocks=0, async_scheduling=on
        ),
        executor,
    )
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for i, p in enumerate(PROMPTS[:2]):
        engine.add_request(str(i), None, params, prompt_token_ids=p)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o.outputs[0].token_ids
    n = len(executor.inputs)
    if on:
        # submit 0, submit 1, result 0, submit 2, result 1, ...: step N+1 was handed over
        # while step N's samples were unread, its decode inputs pending on the device.
        assert executor.calls[:3] == [("submit", 0), ("submit", 1), ("result", 0)]
        assert all(
            executor.calls.index(("submit", k + 1)) < executor.calls.index(("result", k))
            for k in range(n - 1)
        )
        assert all(s.token_ids == [PENDING_TOKEN] for s in executor.inputs[1].seqs)
    else:
        assert executor.calls == [(c, k) for k in range(n) for c in ("submit", "result")]
        assert all(PENDING_TOKEN not in s.token_ids for step in executor.inputs for s in step.seqs)
    # Five tokens each, and no step beyond the one that samples the fifth (max_tokens is known).
    assert [len(outs[str(i)]) for i in range(2)] == [5, 5] and n == 5
    engine.block_manager.check_no_leaks()
