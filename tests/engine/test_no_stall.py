"""The engine never spins: the two requests of issue 11 that used to loop forever now
finish (a preempted multi-sequence group comes back) or fail at once with a typed error."""

from __future__ import annotations

import pytest

from streamkv import LLM, SamplingParams

MAX_STEPS = 2000  # the stalls this guards against ran hundreds of thousands of empty steps


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir):
    return tiny_llama_dir


def _drive(engine, late: tuple[int, str, list[int], SamplingParams] | None = None) -> dict:
    """Step until nothing is left (at most MAX_STEPS); returns the finished outputs by id."""
    done = {}
    for step in range(MAX_STEPS):
        if late is not None and step == late[0]:
            engine.add_request(late[1], None, late[3], prompt_token_ids=late[2])
        if step > (late[0] if late else 0) and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


# recompute with 16 swap blocks, the third case, runs at the scheduler level
# (tests/core/test_scheduler.py), where it costs no model.
@pytest.mark.parametrize("mode, swap_blocks", [("recompute", 0), ("auto", 0)])
def test_preempted_parallel_sampling_group_is_readmitted(model_dir, mode, swap_blocks):
    llm = LLM(
        str(model_dir),
        device="cpu",
        block_size=8,
        num_kv_blocks=16,
        num_swap_blocks=swap_blocks,
        preemption_mode=mode,
        max_model_len=128,
        enable_prefix_caching=False,
    )
    try:
        engine = llm.engine
        engine.add_request(
            "Y",
            None,
            SamplingParams(temperature=0, max_tokens=80, ignore_eos=True),
            prompt_token_ids=list(range(3, 19)),
        )
        engine.add_request(
            "X",
            None,
            SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=12, ignore_eos=True),
            prompt_token_ids=list(range(100, 148)),
        )
        z = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        done = _drive(engine, (60, "Z", list(range(500, 510)), z))
        assert set(done) == {"X", "Y", "Z"}, (
            f"unfinished after {MAX_STEPS} steps: {set('XYZ') - set(done)}"
        )
        for rid, n, length in (("X", 4, 12), ("Y", 1, 80), ("Z", 1, 4)):
            assert done[rid].error is None
            assert [len(c.token_ids) for c in done[rid].outputs] == [length] * n
        assert engine.scheduler.num_preemptions > 0  # the scenario really preempted X
        engine.block_manager.check_no_leaks()
    finally:
        llm.shutdown()


def test_best_of_over_max_num_seqs_is_refused(model_dir):
    llm = LLM(
        str(model_dir),
        device="cpu",
        num_kv_blocks=64,
        num_swap_blocks=0,
        max_num_seqs=2,
        max_model_len=128,
    )
    try:
        engine = llm.engine
        with pytest.raises(ValueError, match="max_num_seqs") as info:
            engine.add_request(
                "B", None, SamplingParams(best_of=3, max_tokens=4), prompt_token_ids=[5, 6, 7]
            )
            _drive(engine)  # on the old code: bounded, where LLM.generate spun forever
        assert getattr(info.value, "param", None) == "best_of"
        assert not engine.has_unfinished_requests()
        engine.block_manager.check_no_leaks()
    finally:
        llm.shutdown()
