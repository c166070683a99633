"""Engine behaviour on the real model: errors, stop conditions, streaming text, seeds."""

from __future__ import annotations

import pytest

from streamkv import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(block_size=16, num_kv_blocks=256, num_swap_blocks=64, max_model_len=1024)


def test_infeasible_request_is_refused_and_the_engine_goes_on(llm):
    # Admission rules are tested one by one on a tiny model (tests/engine/test_admission.py).
    tok = llm.get_tokenizer()
    ok = tok.encode("The capital of France is")
    too_long = [tok.encode("hello")[0]] * 2000  # over max_model_len
    with pytest.raises(ValueError, match="maximum context length") as info:
        llm.generate(
            prompt_token_ids=[ok, too_long, ok],
            sampling_params=SamplingParams(temperature=0, max_tokens=8),
        )
    assert info.value.param == "prompt"
    outs = llm.generate(
        prompt_token_ids=[ok, ok], sampling_params=SamplingParams(temperature=0, max_tokens=8)
    )
    for out in outs:
        assert out.error is None and out.outputs[0].finish_reason == "length"
        assert len(out.outputs[0].token_ids) == 8
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_bad_input_raises_and_engine_keeps_working(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate(prompt_token_ids=[[]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(prompt_token_ids=[[10**9]])
    out = llm.generate("Hello", SamplingParams(max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        # A finished grammar allows only a stop token, which min_tokens bans: refused, not dropped.
        ({"min_tokens": 4, "structured_outputs": {"choice": ["yes", "no"]}}, "min_tokens"),
    ],
)
def test_sampling_params_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_top_k_zero_means_off_as_in_vllm():
    assert SamplingParams(top_k=0).top_k == SamplingParams().top_k == -1
    assert SamplingParams(top_k=5).top_k == 5


def test_stop_string_is_trimmed_and_streamed_text_never_shows_it(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, stop=[" 7"])
    engine.add_request("stop-test", "1, 2, 3, 4,", params)
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append(out.outputs[0].text)
    final = seen[-1]
    assert final.strip().endswith("6,") and " 7" not in final
    assert all(" 7" not in text for text in seen)
    assert all(final.startswith(text) for text in seen)  # text only ever grows


def test_incremental_text_equals_full_decode_for_multibyte_output(llm):
    tok = llm.get_tokenizer()
    prompt = "Translate to Chinese and add emoji: I love the sunny beach 🌞🏖️. Answer:"
    out = llm.generate(
        prompt, SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True)
    )[0]
    comp = out.outputs[0]
    assert comp.text == tok.decode(comp.token_ids, skip_special_tokens=True)
    assert "\ufffd" not in comp.text


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate("Tell me a story", params)[0].outputs[0].token_ids
    batch = llm.generate(
        ["Tell me a story", "Something else entirely", "Tell me a story"],
        [params, SamplingParams(temperature=1.0, max_tokens=30), params],
    )
    assert batch[0].outputs[0].token_ids == alone
    assert batch[2].outputs[0].token_ids == alone
    other = llm.generate(
        "Tell me a story", SamplingParams(temperature=1.0, seed=99, max_tokens=20, ignore_eos=True)
    )
    assert other[0].outputs[0].token_ids != alone


def test_min_tokens_and_logprobs(llm):
    out = llm.generate(
        "Hi", SamplingParams(temperature=0, min_tokens=30, max_tokens=30, logprobs=3)
    )[0].outputs[0]
    assert len(out.token_ids) == 30
    assert len(out.logprobs) == 30
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and len(lp) >= 3
        assert lp[tok].rank == 1  # greedy picks the top token


def test_abort_frees_blocks(llm):
    engine = llm.engine
    engine.add_request(
        "to-abort",
        "Write a very long essay about the sea.",
        SamplingParams(max_tokens=200, ignore_eos=True),
    )
    for _ in range(3):
        engine.step()
    assert engine.block_manager.device.num_free < engine.block_manager.device.num_blocks
    out = engine.abort_request("to-abort")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()


def test_finished_only_steps_return_the_same_final_outputs(llm):
    # LLM.generate steps with finished_only=True; streaming consumers take every output.
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in ("One, two,", "The sky is", "def f(x):")]
    params = [SamplingParams(temperature=0, max_tokens=n, stop=["\n\n"]) for n in (3, 9, 6)]
    engine = llm.engine
    finals: dict[str, dict] = {}
    for mode in (False, True):
        for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"{mode}-{i}", None, p, prompt_token_ids=ids)
        seen, final = [], {}
        while engine.has_unfinished_requests():
            outs = engine.step(finished_only=mode)
            seen += outs
            final.update({o.request_id.split("-")[1]: o for o in outs if o.finished})
        assert all(o.finished for o in seen) if mode else any(not o.finished for o in seen)
        finals[mode] = {
            k: (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
            for k, o in final.items()
        }
    assert finals[True] == finals[False] and len(finals[True]) == 3
    engine.block_manager.check_no_leaks()


def test_token_ids_past_the_vocabulary_are_refused_alone(llm):
    # They would index the logits inside a batched step and fail every request in it.
    ok = SamplingParams(temperature=0, max_tokens=3)
    for bad in (
        SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=[10**6]),
        SamplingParams(max_tokens=3, logit_bias={10**6: 1.0}),
    ):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=bad)
    # A top_k past the vocabulary is no filter at all, not an error.
    big_k = llm.generate(
        prompt_token_ids=[[5, 6, 7]],
        sampling_params=SamplingParams(max_tokens=3, top_k=10**6, seed=1, ignore_eos=True),
    )
    assert len(big_k[0].outputs[0].token_ids) == 3
    assert (
        len(llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=ok)[0].outputs[0].token_ids)
        == 3
    )
    llm.engine.block_manager.check_no_leaks()


def test_logit_bias_offline(llm):
    out = llm.generate(
        prompt_token_ids=[[5, 6, 7]],
        sampling_params=SamplingParams(temperature=0, max_tokens=4, logit_bias={42: 100.0}),
    )
    assert out[0].outputs[0].token_ids == [42, 42, 42, 42]
