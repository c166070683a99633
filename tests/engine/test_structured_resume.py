"""A structured request resumed after a worker restart (engine/recovery.py: its outputs so
far become the prompt's tail, ``resumed_output_tokens`` of them) continues its grammar where
it stood: greedy, it produces the rest of the fault-free run's output, not a second value."""

from __future__ import annotations

import dataclasses

import pytest

from streamkv import LLM, SamplingParams
from tests.tiny_models import TEXT

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
}

pytestmark = pytest.mark.slow  # a tiny model with the embedded tokenizer, grammars compiled: ~10 s


def _run(llm: LLM, rid: str, ids: list[int], params: SamplingParams) -> list[int]:
    llm.engine.add_request(rid, None, params, ids)
    final = None
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.request_id == rid and out.finished:
                final = out
    return list(final.outputs[0].token_ids)


@pytest.mark.parametrize("spec", [{"json": SCHEMA}, {"regex": "[0-9]{3}-[0-9]{2}"}])
def test_a_resumed_structured_request_continues_its_grammar(tiny_llama, spec):
    path = tiny_llama(**TEXT)
    llm = LLM(
        str(path),
        device="cpu",
        max_model_len=256,
        num_swap_blocks=0,
        block_size=4,
        num_kv_blocks=256,
    )
    try:
        prompt = llm.engine.tokenizer.encode("A record:")
        params = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=spec)
        whole = _run(llm, "whole", prompt, params)
        assert len(whole) >= 4, whole
        k = len(whole) // 2
        resumed = dataclasses.replace(
            params, max_tokens=params.max_tokens - k, resumed_output_tokens=k
        )
        rest = _run(llm, "resumed", prompt + whole[:k], resumed)
        assert rest == whole[k:]
        llm.engine.block_manager.check_no_leaks()
    finally:
        llm.shutdown()
