"""Every number a request may carry, at the float limits (denormals, +-inf, NaN, 1e+-308):
refused when built with an InvalidParameter naming its field, or, once accepted, sampled in
bounded time. Before issue 26, ``top_p=1e-46`` passed the ``> 0`` check, became 0 in
float32, and the nucleus test could never pass: the engine thread spun forever."""

from __future__ import annotations

import math
import signal
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamkv.layers.sample_request import SampleRequest
from streamkv.layers.sampler import Sampler
from streamkv.sampling_params import InvalidParameter, SamplingParams

EXTREMES = [
    0.0,
    -0.0,
    5e-324,
    -5e-324,
    1e-46,
    1e-40,
    1e-38,
    1e-30,
    1e-8,
    1e-5,
    0.5,
    1.0,
    1.0000001,
    2.0,
    100.0,
    1e38,
    3.5e38,
    1e308,
    -1e308,
    math.inf,
    -math.inf,
    math.nan,
    -1.0,
]
FLOAT_FIELDS = [
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "length_penalty",
]
VOCAB = 64


@contextmanager
def deadline(seconds: int):
    """Fail instead of hanging (the bug this file guards against was a hang)."""

    def fire(*_):
        raise TimeoutError(f"still sampling after {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _built(**kwargs) -> SamplingParams | None:
    try:
        return SamplingParams(**kwargs)
    except InvalidParameter as e:
        assert e.param in kwargs, (e.param, kwargs)
        assert e.param in str(e)
        return None


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", EXTREMES)
def test_each_float_is_refused_by_name_or_usable(field: str, value: float) -> None:
    params = _built(**{field: value})
    if params is None:
        return
    got = getattr(params, field)
    assert math.isfinite(got)
    if got != 0.0:
        # Whatever is accepted survives the trip to float32 without underflow or overflow.
        f32 = torch.tensor(got, dtype=torch.float32).item()
        assert math.isfinite(f32) and abs(f32) >= torch.finfo(torch.float32).tiny


@pytest.mark.parametrize("value", [1e-46, 5e-324, 0.0, math.nan, math.inf, -1e-9])
def test_tiny_top_p_is_a_400_naming_top_p(value: float) -> None:
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(temperature=1.0, top_p=value)
    assert e.value.param == "top_p"


@pytest.mark.parametrize("bias", [math.nan, math.inf, -math.inf, 1e308, True])
def test_logit_bias_values_must_be_finite_numbers(bias) -> None:
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(logit_bias={3: bias})
    assert e.value.param == "logit_bias"


def test_sizes_are_bounded() -> None:
    for kwargs, param in (
        ({"stop": ["x"] * 33}, "stop"),
        ({"stop": ["x" * 1025]}, "stop"),
        ({"stop_token_ids": list(range(1025))}, "stop_token_ids"),
        ({"logit_bias": {t: 1.0 for t in range(1025)}}, "logit_bias"),
    ):
        with pytest.raises(InvalidParameter) as e:
            SamplingParams(**kwargs)
        assert e.value.param == param
        assert len(str(e.value)) < 400  # the refused value is quoted, shortened


def test_the_sampler_survives_a_top_p_that_underflows_float32() -> None:
    # Below admission: the draw itself must end even if a zero top_p reaches it.
    x = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    reqs = [SampleRequest(temperature=1.0, top_p=1e-46, seed=s) for s in (None, 7)] + [
        SampleRequest(temperature=1.0)
    ]
    with deadline(10):
        out = Sampler()(x.clone(), reqs)
        out.finalize()
    assert out[0].token_ids == [int(x[0].argmax())] and out[1].token_ids == [int(x[1].argmax())]


_accepted = st.builds(
    dict,
    temperature=st.sampled_from(EXTREMES),
    top_p=st.sampled_from(EXTREMES),
    min_p=st.sampled_from(EXTREMES),
    presence_penalty=st.sampled_from(EXTREMES),
    frequency_penalty=st.sampled_from(EXTREMES),
    repetition_penalty=st.sampled_from(EXTREMES),
    seed=st.one_of(st.none(), st.integers(-(2**70), 2**70)),
    top_k=st.sampled_from([-1, 1, 2, VOCAB, 10**9]),
    bias=st.sampled_from(EXTREMES + [-100.0, 100.0]),
)


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


@pytest.mark.parametrize(
    "device", DEVICES
)  # on CUDA the sampler's kernels draw (kernels_cu/sampling.cu)
@settings(max_examples=200, deadline=None)
@given(kw=_accepted, logits_scale=st.sampled_from([1.0, 1e4, 1e30, 3e38]))
def test_accepted_extremes_sample_a_real_token_in_bounded_time(
    device: str, kw: dict, logits_scale: float
) -> None:
    bias = kw.pop("bias")
    params = _built(**kw, logit_bias={1: bias})
    if params is None:
        return
    x = (torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1)) * logits_scale).to(
        device
    )
    req = SampleRequest(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        seed=params.seed,
        logit_bias=params.logit_bias,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
    )
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0:
        from streamkv.layers.penalties import TokenCounts

        counts = TokenCounts(VOCAB, device)
        req.counts, req.counts_row = counts, counts.allocate([1, 2, 3], [4, 5])
    with deadline(10):
        out = Sampler(device=device)(x, [req, SampleRequest(temperature=1.0, top_p=0.5)])
        out.finalize()
    assert 0 <= out[0].token_ids[0] < VOCAB and 0 <= out[1].token_ids[0] < VOCAB


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama):
    from streamkv import LLM

    path = tiny_llama(
        vocab_size=VOCAB * 4,
        max_position_embeddings=64,
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    llm = LLM(str(path), device="cpu", num_kv_blocks=64, num_swap_blocks=0, max_model_len=64)
    yield llm
    llm.shutdown()


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(kw=_accepted)
def test_an_accepted_request_finishes_within_max_tokens_steps(tiny_llm, kw: dict) -> None:
    bias = kw.pop("bias")
    params = _built(**kw, logit_bias={1: bias}, max_tokens=4, ignore_eos=True)
    if params is None:
        return
    control = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with deadline(30):
        outs = tiny_llm.generate(
            prompt_token_ids=[[5, 17, 30, 2]] * 2, sampling_params=[params, control]
        )
    assert all(o.finished and o.error is None for o in outs)
    assert len(outs[0].outputs[0].token_ids) == 4
