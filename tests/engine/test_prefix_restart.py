"""Reserved prefixes outlive a worker restart (engine/reserved_prefixes.carry_prefixes)."""

from __future__ import annotations

from streamkv import LLM, SamplingParams


def test_prefixes_are_carried_over_a_restart_under_their_ids(tiny_llama_dir):
    """A worker restart builds a new engine; the prefixes registered on the old one come back
    on it, computed, under the same ids, before it takes requests (issue 26: the list was
    empty after a restart and their owners got no error)."""
    from streamkv.engine.reserved_prefixes import carry_prefixes, register_prefix, reserved_prefixes

    kwargs = dict(device="cpu", block_size=8, num_kv_blocks=64, num_swap_blocks=0)
    old, new = LLM(str(tiny_llama_dir), **kwargs), LLM(str(tiny_llama_dir), **kwargs)
    try:
        first = old.register_prefix(list(range(3, 27)))
        second = old.register_prefix(list(range(40, 58)))
        assert carry_prefixes(old.engine, new.engine) == [first, second]
        carried = reserved_prefixes(new.engine).prefixes
        assert sorted(carried) == sorted([first, second]) and all(p.ready for p in carried.values())
        assert carried[first].token_ids == tuple(range(3, 27))
        # A prefix registered after the restart takes a fresh id.
        assert register_prefix(new.engine, list(range(100, 116))).prefix_id not in (first, second)
        out = new.generate(
            None, SamplingParams(max_tokens=2, temperature=0), prompt_token_ids=[list(range(3, 30))]
        )
        assert len(out[0].outputs[0].token_ids) == 2 and new.reserved_prefixes()[0]["num_uses"] == 1
    finally:
        old.shutdown()
        new.shutdown()
