"""benchmarks/step_phases.py wraps engine methods by name: a rename must fail here, not in a
GPU run."""

import pytest

from benchmarks.step_phases import PhaseClock, _targets


def test_every_timed_method_exists_and_is_restored():
    targets = _targets()
    before = [
        (owner, name, owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name))
        for _, owner, name in targets
    ]
    with PhaseClock():
        for owner, name, fn in before:
            now = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            assert now is not fn
    for owner, name, fn in before:
        now = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        assert now is fn


@pytest.mark.slow  # builds an engine
def test_the_timeline_has_one_entry_per_step_with_its_rows(tiny_llama):
    from streamkv import LLM, SamplingParams

    llm = LLM(str(tiny_llama()), device="cpu", dtype="float32", max_num_seqs=4)
    prompts = [[5 + i, 6, 7, 8] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    with PhaseClock() as clock:
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    steps = clock.calls["step"]
    assert steps > 0 and len(clock.timeline) == steps
    rows = [t[0] for t in clock.timeline]
    assert max(rows) == 4  # max_num_seqs caps a step's rows
    assert sum(t[0] for t in clock.timeline if t[1] == t[0]) > 0  # decode-only steps
    assert all(t[2] >= t[3] >= 0 for t in clock.timeline)  # blocked time within the step's
    report = clock.timeline_report()
    assert sum(b["steps"] for b in report) == sum(1 for t in clock.timeline if t[0] > 0)
    llm.shutdown()
