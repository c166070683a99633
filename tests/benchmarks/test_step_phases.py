"""benchmarks/step_phases.py wraps engine methods by name: a rename must fail here, not in a
GPU run."""

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
