"""The sampler's kernel (kernels_cu/sampling.cu, kernels/sampling_cuda.py).

CPU: the program compiles for sm_80 and sm_90 with NVRTC; the draw table's layout; the
kernel's key schedule (a round's key from a stream's base) equals stream_keys. CUDA: greedy
tokens are torch's argmax and logprobs torch's log_softmax (bf16 / fp16 / fp32, vocabularies
of 49152, 128256 and odd sizes, rows that are not 16-byte aligned); seeded draws equal the
torch path's token for token and do not depend on their batch; unseeded draws follow the
exact top-p / min-p / temperature distribution; no host sync in a sampling call.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamkv.layers.sample_request import SampleRequest
from streamkv.layers.sampler import Sampler
from streamkv.layers.stream_hash import _mix64, stream_bases, stream_keys

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# -- CPU -------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", (80, 90))
def test_sampling_kernel_compiles(arch: int, tmp_path, monkeypatch) -> None:
    pytest.importorskip("cuda.bindings.nvrtc")
    from streamkv.kernels import nvrtc, sampling_cuda

    monkeypatch.setenv("STREAMKV_CACHE_DIR", str(tmp_path))
    names = sampling_cuda.sampling_names()
    compiled = nvrtc.compile_program(sampling_cuda.SAMPLING_SOURCE, names, arch)
    assert set(compiled.lowered) == set(names) and len(names) == 3
    for mangled in compiled.lowered.values():
        assert mangled.encode() in compiled.image


def test_draw_table_layout() -> None:
    pytest.importorskip("cuda.bindings.nvrtc")
    from streamkv.kernels import sampling_cuda

    bases = np.array([0x0123_4567_89AB_CDEF, 2**64 - 1], dtype=np.uint64)
    t = sampling_cuda.draw_table(
        [3, 0], [1, 4 | 1], [0.8, 1.5], [0.95, 1.0], [0.0, 0.1], bases
    ).numpy()
    assert t.shape == (2, 8) and t.dtype == np.int32
    assert t[:, 0].tolist() == [3, 0] and t[:, 1].tolist() == [1, 5]
    assert (
        t[0, 2].view(np.uint32) == 0x89AB_CDEF and t[0, 3].view(np.uint32) == 0x0123_4567
    )  # lo, hi
    assert t[1, 2:4].view(np.uint32).tolist() == [2**32 - 1] * 2
    np.testing.assert_array_equal(
        t[:, 4:7].view(np.float32), np.float32([[0.8, 0.95, 0.0], [1.5, 1.0, 0.1]])
    )
    assert sampling_cuda.threads_for(128_256, torch.bfloat16) == 512
    assert sampling_cuda.threads_for(8, torch.float32) == 32


def test_kernel_plan_modes_draws_and_keys() -> None:
    pytest.importorskip("cuda.bindings.nvrtc")
    from streamkv.kernels import sampling_cuda as k
    from streamkv.layers.sampler import _kernel_plan

    reqs = [
        SampleRequest(),
        SampleRequest(
            temperature=0.8, top_p=0.9, seed=5, output_pos=7, num_samples=2, sample_index=1
        ),
        SampleRequest(temperature=1.0, top_k=40),
        SampleRequest(temperature=0.5, top_k=10**6, min_p=0.1),
        SampleRequest(temperature=0.7, seed=3),
    ]
    draws, modes, table, adjust = _kernel_plan(reqs, 1000)
    assert list(zip(draws.row.tolist(), draws.stream.tolist())) == [
        (0, 0), (1, 1), (1, 2), (2, 0), (3, 0), (4, 0)
    ]  # fmt: skip
    modes = modes.tolist()
    assert (
        modes == [k.GREEDY, k.SAMPLE, k.SAMPLE, k.SCORE, k.SAMPLE | k.UNSEEDED, k.SAMPLE]
        and not adjust
    )
    t = table.numpy()
    assert t[:, 0].tolist() == [0, 1, 1, 2, 3, 4] and t[:, 1].tolist() == modes
    bases = t[:, 2:4].copy().view(np.uint64).ravel()
    assert bases[[1, 2, 5]].tolist() == stream_bases([5, 5, 3], [1, 2, 0], [7, 7, 0]).tolist()
    np.testing.assert_array_equal(t[4, 4:7].view(np.float32), np.float32([0.5, 1.0, 0.1]))
    assert _kernel_plan([SampleRequest(), SampleRequest(banned_token_ids=[3])], 1000)[3]


def test_round_keys_from_a_base_are_stream_keys() -> None:
    # What the kernel computes per round (round_key): fold(mix64(base ^ round)).
    seeds, samples, positions = [1, -7, 2**64 + 3, 42], [0, 1, 2, 0], [0, 5, 9, 1000]
    bases = stream_bases(seeds, samples, positions)
    for r in (0, 1, 2, 17):
        z = _mix64(bases ^ np.uint64(r))
        folded = ((z ^ (z >> np.uint64(32))) & np.uint64(0xFFFF_FFFF)).astype(np.int64)
        assert folded.tolist() == stream_keys(seeds, samples, positions, r).tolist()


# -- CUDA ------------------------------------------------------------------------------------
def _logits(rows: int, vocab: int, dtype, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g, device="cuda") * scale).to(dtype)


def _tokens(out) -> list[int]:
    return [t for r in out for t in r.token_ids]


def _lps(out) -> torch.Tensor:
    return torch.tensor([lp for r in out for lp in r.logprobs])


@pytest.mark.parametrize("vocab", (49_152, 128_256, 50_257, 1000))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.cuda
@needs_gpu
def test_greedy_is_argmax_with_its_logprob(dtype, vocab: int) -> None:
    x = _logits(64, vocab, dtype, seed=vocab)
    x[3, 10] = x[3, vocab - 1] = x[3].max() + 1  # a tie: the first index, as torch.argmax
    x[4, : vocab // 2] = float("-inf")  # banned tokens
    out = Sampler(device="cuda")(x, [SampleRequest() for _ in range(64)])
    ref = x.float().log_softmax(-1)
    want = x.float().argmax(-1)
    assert _tokens(out) == want.tolist()
    torch.testing.assert_close(
        _lps(out), ref.gather(1, want[:, None]).squeeze(1).cpu(), atol=1e-4, rtol=1e-5
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.cuda
@needs_gpu
def test_rows_not_16_byte_aligned(dtype) -> None:
    # A view one column in: every row starts off a 16-byte boundary by a different amount.
    wide = _logits(33, 4099, dtype, seed=5)
    x = wide[:, 1:]
    reqs = [SampleRequest() for _ in range(16)] + [
        SampleRequest(temperature=0.9, top_p=0.7, seed=s) for s in range(17)
    ]
    got = Sampler(device="cuda")(x, reqs)
    want = Sampler()(x.float().cpu(), reqs)
    assert _tokens(got) == _tokens(want)
    torch.testing.assert_close(_lps(got), _lps(want), atol=1e-4, rtol=1e-5)


SEEDED = [
    {"temperature": 0.8, "top_p": 0.95},
    {"temperature": 1.0, "top_p": 0.5},
    {"temperature": 0.7},
    {"temperature": 1.2, "min_p": 0.1},
    {"temperature": 0.9, "top_p": 0.8, "min_p": 0.05},
    {"temperature": 1.0, "top_p": 0.3, "top_k": 40},  # top-k: torch draws, the kernel scores
]


@pytest.mark.parametrize("vocab", (128_256, 49_152, 50_257))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.cuda
@needs_gpu
def test_seeded_draws_equal_the_torch_path(dtype, vocab: int) -> None:
    x = _logits(48, vocab, dtype, seed=7, scale=2.0)
    # Top-k over half-precision logits has ties at the top whose order torch.topk leaves open
    # (and so the top-p cut among them): that row kind only in float32.
    kinds = SEEDED if dtype == torch.float32 else SEEDED[:-1]
    reqs = [
        SampleRequest(seed=100 + i, output_pos=i, sample_index=i % 3, **kinds[i % len(kinds)])
        for i in range(48)
    ]
    got = Sampler(device="cuda")(x, reqs)
    want = Sampler()(x.float().cpu(), reqs)
    assert _tokens(got) == _tokens(want)
    torch.testing.assert_close(_lps(got), _lps(want), atol=1e-4, rtol=1e-5)


@pytest.mark.cuda
@needs_gpu
def test_seeded_draws_do_not_depend_on_their_batch() -> None:
    vocab = 128_256
    x = _logits(6, vocab, torch.bfloat16, seed=9)
    seeded = [SampleRequest(seed=s, output_pos=3, **SEEDED[s]) for s in range(6)]
    alone = [
        _tokens(Sampler(seed=i, device="cuda")(x[i : i + 1], [r])) for i, r in enumerate(seeded)
    ]
    noise = _logits(5, vocab, torch.bfloat16, seed=10)
    others = [
        SampleRequest(temperature=1.0),
        SampleRequest(),
        SampleRequest(temperature=0.5, top_k=3),
        SampleRequest(temperature=1.0, top_p=0.9),
        SampleRequest(temperature=1.0, num_samples=2),
    ]
    order = [5, 2, 0, 4, 1, 3]
    rows = torch.cat([noise[:3], x[order], noise[3:]])
    reqs = others[:3] + [seeded[i] for i in order] + others[3:]
    first, second = (
        Sampler(seed=1, device="cuda")(rows, reqs),
        Sampler(seed=2, device="cuda")(rows, reqs),
    )
    assert [first[3 + k].token_ids for k in range(6)] == [alone[i] for i in order]
    assert [second[3 + k].token_ids for k in range(6)] == [alone[i] for i in order]


@pytest.mark.cuda
@needs_gpu
def test_penalties_bias_and_bans_on_the_kernel_path() -> None:
    # Adjusted rows go through float32 logits first; the draws still equal the torch path's.
    from streamkv.layers.penalties import TokenCounts

    vocab = 32_000
    x = _logits(8, vocab, torch.bfloat16, seed=12)

    def reqs(device: str) -> list[SampleRequest]:
        counts = TokenCounts(vocab, device, capacity=8)
        rows = [counts.allocate([1, 2, 3, 40 * i], [5, 5, 6 + i]) for i in range(8)]
        pen = {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.3}
        return [
            SampleRequest(
                counts=counts,
                counts_row=rows[i],
                logit_bias={7: 2.0},
                banned_token_ids=[9],
                **pen,
                **({"temperature": 0.8, "top_p": 0.9, "seed": i} if i % 2 else {}),
            )
            for i in range(8)
        ]

    got = Sampler(device="cuda")(x, reqs("cuda"))
    want = Sampler()(x.float().cpu(), reqs("cpu"))
    assert _tokens(got) == _tokens(want)
    torch.testing.assert_close(_lps(got), _lps(want), atol=1e-4, rtol=1e-5)


def _filtered(p: torch.Tensor, top_p: float, min_p: float) -> torch.Tensor:
    """The exact target: the nucleus of p (by its own cumulative mass), min_p-cut, renormalised."""
    sorted_p, idx = p.sort(descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    keep[idx[(sorted_p.cumsum(0) - sorted_p) < top_p]] = True
    keep &= p >= min_p * p.max()
    q = torch.where(keep, p, 0.0)
    return q / q.sum()


@pytest.mark.parametrize(
    "req",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_p": 0.6},
        {"temperature": 1.3, "top_p": 0.9, "min_p": 0.08},
        {"temperature": 0.5, "min_p": 0.2},
    ],
)
@pytest.mark.cuda
@needs_gpu
def test_unseeded_draws_follow_the_filtered_distribution(req) -> None:
    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 0.2, 1.2, -2.0])
    draws = 200_000
    x = base.to(torch.bfloat16).cuda().repeat(draws, 1)
    want = _filtered(
        (x[0].float().cpu() / req["temperature"]).softmax(0),
        req.get("top_p", 1.0),
        req.get("min_p", 0.0),
    )
    out = Sampler(seed=3, device="cuda")(x, [SampleRequest(**req)] * draws)
    got = torch.bincount(torch.tensor(_tokens(out)), minlength=len(base)).double() / draws
    assert (got[want == 0] == 0).all(), (got, want)
    # ~9 standard deviations of a frequency at 200k draws; the chi-square on top of it.
    assert (got - want).abs().max() < 0.01, (got, want)
    seen = want > 0
    chi2 = (draws * (got[seen] - want[seen]) ** 2 / want[seen]).sum().item()
    assert chi2 < 40, (chi2, got, want)  # dof <= 10: p < 1e-4 for a correct sampler


@pytest.mark.parametrize("with_top_k", (False, True))
@pytest.mark.cuda
@needs_gpu
def test_a_sampling_call_never_syncs(with_top_k: bool) -> None:
    x = _logits(16, 128_256, torch.bfloat16, seed=11)
    reqs = [
        SampleRequest(),
        SampleRequest(temperature=0.8, top_p=0.95),
        SampleRequest(temperature=0.8, top_p=0.95, seed=1),
        SampleRequest(temperature=1.0, min_p=0.1, top_p=0.5),
    ] * 4
    if with_top_k:
        reqs[0] = SampleRequest(temperature=0.8, top_k=50, seed=2)
    sampler = Sampler(device="cuda")
    sampler(x, reqs).results()  # compiles and loads the kernel
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = sampler(x, reqs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(batch.results()) == 16
