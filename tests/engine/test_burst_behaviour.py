"""What a burst of requests meets in the engine. The server's engine thread passes the
requests whose last output its reader has not taken yet (EngineCommands.unread): the engine
builds no new snapshot for them while they run (the
reader would skip to the newest anyway, outputs being cumulative), and always their final
one. The outputs the reader does get are the same cumulative text and tokens."""

from __future__ import annotations

from streamkv import LLM, SamplingParams


def test_unread_requests_get_no_snapshot_until_they_finish(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=64, num_swap_blocks=0)
    try:
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        engine.add_request("slow", None, params, prompt_token_ids=[1, 2, 3, 4])
        engine.add_request("fast", None, params, prompt_token_ids=[5, 6, 7, 8])
        seen: dict[str, list] = {"slow": [], "fast": []}
        while engine.has_unfinished_requests():
            for out in engine.step(unread={"slow"}):
                seen[out.request_id].append(out)
        assert len(seen["fast"]) == 6  # one snapshot per step
        assert len(seen["slow"]) == 1 and seen["slow"][0].finished  # only the final one
        assert len(seen["slow"][0].outputs[0].token_ids) == 6
        engine.block_manager.check_no_leaks()
    finally:
        llm.shutdown()


def test_one_generate_call_with_a_common_system_prompt_computes_it_once(tiny_llama_dir):
    """Four prompts with the same 96-token system prompt in one ``generate`` call: the first
    computes its 6 full blocks, the other three map them (they used to compute a copy each in
    the same step: 0 hits). Greedy outputs equal those of the prefix cache off."""
    system = [(7 * i) % 500 + 3 for i in range(96)]
    ids = [system + [600 + 10 * k + j for j in range(5)] for k in range(4)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    runs = {}
    for caching in (True, False):
        llm = LLM(
            str(tiny_llama_dir),
            device="cpu",
            num_kv_blocks=64,
            num_swap_blocks=0,
            enable_prefix_caching=caching,
        )
        try:
            runs[caching] = [
                o.outputs[0].token_ids for o in llm.generate(None, params, prompt_token_ids=ids)
            ]
            if caching:
                assert llm.stats()["prefix_cache_hits"] == 3 * 96
            llm.engine.block_manager.check_no_leaks()
        finally:
            llm.shutdown()
    assert runs[True] == runs[False]
