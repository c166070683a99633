"""Reserved shared prefixes through the offline engine (a tiny random Llama on the CPU):
greedy outputs equal to not registering, the prefix computed once, under preemption too, and
the --reserved-prefix file flag. The block manager's side: tests/core/test_reserved_prefix.py."""

from __future__ import annotations

import pytest

from streamkv import SamplingParams
from streamkv.entrypoints.llm import LLM


@pytest.mark.parametrize("caching", [False, True])
def test_engine_outputs_equal_and_prefix_computed_once(tiny_llama_dir, caching):
    prefix = [(7 * i) % 997 + 1 for i in range(37)]  # 4 whole blocks of 8 + 5 tokens
    prompts = [prefix + [11 + i, 23, 5 + i] for i in range(6)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    kw = dict(
        device="cpu",
        block_size=8,
        num_kv_blocks=64,
        num_swap_blocks=0,
        max_model_len=128,
        enable_prefix_caching=caching,
    )
    plain = LLM(str(tiny_llama_dir), **kw)
    expected = [
        o.outputs[0].token_ids
        for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)
    ]
    plain.shutdown()

    llm = LLM(str(tiny_llama_dir), **kw)
    pid = llm.register_prefix(prefix)
    assert llm.stats()["num_prompt_tokens"] == len(prefix)  # computed once, at registration
    assert llm.stats()["num_pinned_kv_blocks"] == 4
    got = [
        o.outputs[0].token_ids
        for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)
    ]
    assert got == expected
    # Every prompt computed only what follows the 32 shared tokens (with the cache on too:
    # the requests arrive together, so none can hit another's blocks before they exist).
    assert llm.stats()["num_prompt_tokens"] == len(prefix) + sum(len(p) - 32 for p in prompts)
    assert llm.reserved_prefixes()[0]["num_uses"] == len(prompts)
    llm.engine.block_manager.check_no_leaks()
    llm.unregister_prefix(pid)
    assert llm.stats()["num_pinned_kv_blocks"] == 0
    llm.engine.block_manager.check_no_leaks()
    llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_engine_outputs_equal_under_preemption(tiny_llama_dir, mode):
    """A pool too small for the batch: requests that map the pinned prefix are preempted
    (swapped out with their copy of it, or dropped and mapped again) and still match."""
    prefix = [(11 * i) % 997 + 2 for i in range(24)]  # 3 whole blocks of 8
    prompts = [prefix + [40 + i] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    kw = dict(
        device="cpu",
        block_size=8,
        num_kv_blocks=20,
        num_swap_blocks=40,
        max_model_len=128,
        enable_prefix_caching=False,
        preemption_mode=mode,
    )
    plain = LLM(str(tiny_llama_dir), **kw)
    expected = [
        o.outputs[0].token_ids
        for o in plain.generate(prompt_token_ids=prompts, sampling_params=params)
    ]
    plain.shutdown()
    llm = LLM(str(tiny_llama_dir), **kw)
    pid = llm.register_prefix(prefix)
    got = [
        o.outputs[0].token_ids
        for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)
    ]
    assert got == expected
    assert llm.stats()["num_preemptions"] > 0
    llm.engine.block_manager.check_no_leaks()
    llm.unregister_prefix(pid)
    llm.engine.block_manager.check_no_leaks()
    llm.shutdown()


@pytest.mark.slow
def test_prefix_file_flag_is_read_and_pinned(tiny_llama_dir, tmp_path):
    system = "You are a careful assistant. Answer briefly and politely, in plain English.\n" * 3
    path = tmp_path / "system.txt"
    path.write_text(system)
    llm = LLM(
        None,
        device="cpu",
        block_size=16,
        num_kv_blocks=64,
        num_swap_blocks=0,
        max_model_len=256,
        reserved_prefix=(str(path),),
    )  # the embedded model: it has a tokenizer
    [info] = llm.reserved_prefixes()
    assert info["status"] == "ready" and info["num_blocks"] == info["num_tokens"] // 16 > 0
    assert llm.stats()["num_pinned_kv_blocks"] == info["num_blocks"]
    llm.generate([system + "Hi"], SamplingParams(max_tokens=2))
    assert llm.reserved_prefixes()[0]["num_uses"] == 1
    llm.shutdown()
    with pytest.raises(ValueError, match="no tokenizer"):
        LLM(
            str(tiny_llama_dir),
            device="cpu",
            num_kv_blocks=32,
            num_swap_blocks=0,
            reserved_prefix=(str(path),),
        )
    with pytest.raises(ValueError, match="cannot read"):
        LLM(
            str(tiny_llama_dir),
            device="cpu",
            num_kv_blocks=32,
            num_swap_blocks=0,
            reserved_prefix=(str(tmp_path / "missing.txt"),),
        )
