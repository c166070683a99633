"""The sampler on hand-made logits: logit bias, and parameters past the vocabulary."""

from __future__ import annotations

import pytest
import torch

from streamkv.layers.sample_request import SampleRequest
from streamkv.layers.sampler import Sampler

VOCAB = 50


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def test_logit_bias_moves_greedy_and_sampled_choices() -> None:
    x = logits(3)
    plain = Sampler()(x.clone(), [SampleRequest(), SampleRequest(), SampleRequest()])
    top = [r.token_ids[0] for r in plain]
    forced = (top[0] + 1) % VOCAB
    reqs = [
        SampleRequest(logit_bias={forced: 100.0}),  # greedy: +100 wins
        SampleRequest(logit_bias={top[1]: -100.0}),  # greedy: the best token is banned
        SampleRequest(temperature=1.0, seed=3, logit_bias={7: 100.0}),  # sampled: +100 wins
    ]
    out = Sampler()(x.clone(), reqs)
    assert out[0].token_ids == [forced]
    assert out[1].token_ids != [top[1]]
    assert out[2].token_ids == [7]
    # Logprobs are of the biased distribution: a +100 token takes almost all the mass.
    assert out[0].logprobs[0] > -1e-3


def test_logit_bias_leaves_other_rows_alone() -> None:
    x = logits(2, seed=1)
    want = Sampler()(x.clone(), [SampleRequest(), SampleRequest()])
    got = Sampler()(x.clone(), [SampleRequest(logit_bias={0: 100.0}), SampleRequest()])
    assert got[0].token_ids == [0]
    assert got[1].token_ids == want[1].token_ids and got[1].logprobs == want[1].logprobs


def test_min_tokens_ban_beats_a_positive_bias() -> None:
    out = Sampler()(logits(1), [SampleRequest(logit_bias={5: 100.0}, banned_token_ids=[5])])
    assert out[0].token_ids != [5]


def test_top_k_and_top_logprobs_past_the_vocabulary() -> None:
    # Sampling with top_k over the vocabulary is plain sampling; asking for more top
    # logprobs than tokens returns them all. Neither may fail the batch.
    x = logits(2, seed=2)
    same_seed = SampleRequest(temperature=0.8, seed=9)
    want = Sampler()(x.clone(), [same_seed, SampleRequest()])
    got = Sampler()(
        x.clone(),
        [SampleRequest(temperature=0.8, seed=9, top_k=10**6), SampleRequest(logprobs=VOCAB + 5)],
    )
    assert got[0].token_ids == want[0].token_ids
    assert len(got[1].top_logprobs[0]) == VOCAB


# -- the batched sampler ---------------------------------------------------------------------
def _tokens(out) -> list[int]:
    return [t for r in out for t in r.token_ids]


def test_greedy_is_exactly_the_argmax_after_bias_and_bans() -> None:
    x = logits(64, seed=3)
    x[5, 7] = x[5, 8] = x[5].max() + 1.0  # a tie: the first index wins, as argmax says
    reqs = [SampleRequest() for _ in range(64)]
    reqs[9] = SampleRequest(logit_bias={3: 5.0}, banned_token_ids=[int(x[9].argmax())])
    want = x.clone()
    want[9, 3] += 5.0
    want[9, int(x[9].argmax())] = float("-inf")
    assert _tokens(Sampler()(x.clone(), reqs)) == want.argmax(-1).tolist()


SEEDED = [
    SampleRequest(temperature=0.8, seed=1),
    SampleRequest(temperature=1.3, top_k=5, seed=2, output_pos=4),
    SampleRequest(temperature=1.0, top_p=0.3, seed=3),
    SampleRequest(temperature=0.7, top_k=20, top_p=0.5, min_p=0.05, seed=4),
    SampleRequest(temperature=1.0, min_p=0.2, top_p=0.6, seed=5, sample_index=2),
]


def test_seeded_samples_do_not_depend_on_their_batch() -> None:
    x = logits(len(SEEDED), seed=4)
    alone = [Sampler(seed=i)(x[i : i + 1].clone(), [r])[0].token_ids for i, r in enumerate(SEEDED)]
    # The same rows among unseeded, greedy and other seeded rows, in another order, on a
    # sampler with another generator state.
    noise = logits(6, seed=5)
    others = [
        SampleRequest(temperature=1.0),
        SampleRequest(),
        SampleRequest(temperature=0.5, top_k=3),
        SampleRequest(temperature=1.0, top_p=0.9),
        SampleRequest(temperature=2.0, seed=77),
        SampleRequest(logprobs=2),
    ]
    order = [4, 2, 0, 3, 1]
    rows = torch.cat([noise[:3], x[order], noise[3:]])
    out = Sampler(seed=123)(rows, others[:3] + [SEEDED[i] for i in order] + others[3:])
    assert [out[3 + k].token_ids for k in range(5)] == [alone[i] for i in order]


def test_a_seed_is_a_stream_over_positions_and_samples() -> None:
    x = logits(1, seed=6).repeat(64, 1)
    at = [SampleRequest(temperature=1.0, seed=8, output_pos=p) for p in range(64)]
    tokens = _tokens(Sampler()(x.clone(), at))
    assert tokens == _tokens(Sampler(seed=5)(x.clone(), at))
    assert len(set(tokens)) > 10  # positions draw independently
    fan = Sampler()(
        x[:1].clone(), [SampleRequest(num_samples=3, temperature=1.0, seed=8, output_pos=5)]
    )
    one_by_one = [
        Sampler()(
            x[:1].clone(), [SampleRequest(temperature=1.0, seed=8, output_pos=5, sample_index=j)]
        )
        for j in range(3)
    ]
    assert fan[0].token_ids == [o[0].token_ids[0] for o in one_by_one]


def _frequencies(x: torch.Tensor, req: dict, draws: int) -> torch.Tensor:
    reqs = [SampleRequest(seed=s, **req) for s in range(draws)]
    got = torch.tensor(_tokens(Sampler()(x.repeat(draws, 1), reqs)))
    return torch.bincount(got, minlength=x.shape[1]).float() / draws


def _nucleus(p: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_p, idx = p.sort(descending=True)
    keep = (sorted_p.cumsum(0) - sorted_p) < top_p
    q = torch.zeros_like(p)
    q[idx[keep]] = p[idx[keep]]
    return q / q.sum()


@pytest.mark.parametrize(
    "req",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_p": 0.6},  # full vocabulary, draws outside the nucleus redrawn
        {"temperature": 1.0, "top_k": 4, "top_p": 0.8},
    ],
)
def test_draws_follow_the_filtered_distribution(req) -> None:
    x = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])
    p = (x[0] / req["temperature"]).softmax(0)
    if "top_k" in req:
        p[p.argsort(descending=True)[req["top_k"] :]] = 0
        p /= p.sum()
    want = _nucleus(p, req.get("top_p", 1.0))
    got = _frequencies(x, req, 20000)
    assert (got - want).abs().max() < 0.015, (got, want)
    assert (got[want == 0] == 0).all()


def test_counter_based_exponentials() -> None:
    from streamkv.layers.stream_hash import hashed_exponentials, stream_keys

    keys = stream_keys([1, 1, 2], [0, 0, 0], [0, 1, 0])
    assert (
        len(set(keys.tolist() + stream_keys([1, -1, 2**64 + 1], [1, 0, 0], [0, 0, 0], 1).tolist()))
        == 6
    )
    assert keys.tolist() == stream_keys([2, 1, 1], [0, 0, 0], [0, 1, 0]).tolist()[::-1]
    q = hashed_exponentials(keys, torch.arange(200_000))
    assert (q > 0).all() and torch.isfinite(q).all()
    assert abs(q.mean().item() - 1.0) < 0.01 and abs(q.var().item() - 1.0) < 0.03
    assert not torch.equal(q[0], q[1]) and not torch.equal(q[0], q[2])
    again = hashed_exponentials(keys[:1], torch.tensor([[5, 199_999]]))
    assert again.tolist() == [[q[0, 5].item(), q[0, 199_999].item()]]


def test_no_generator_per_row_and_no_vocabulary_sort(monkeypatch) -> None:
    x = logits(8, seed=7)
    reqs = [SampleRequest(temperature=1.0, top_p=0.5, seed=i) for i in range(4)]
    reqs += [SampleRequest(temperature=1.0, top_k=5, top_p=0.9, seed=i) for i in range(4)]
    sampler = Sampler()

    def refuse(*args, **kwargs):
        raise AssertionError("called during a sampling step")

    monkeypatch.setattr(torch, "Generator", refuse)
    monkeypatch.setattr(torch, "sort", refuse)
    monkeypatch.setattr(torch.Tensor, "sort", refuse)
    monkeypatch.setattr(torch.Tensor, "argsort", refuse)
    assert len(_tokens(sampler(x, reqs))) == 8


def test_top_logprobs_only_for_the_rows_that_ask() -> None:
    x = logits(3, seed=8)
    out = Sampler()(
        x.clone(), [SampleRequest(), SampleRequest(logprobs=3), SampleRequest(num_candidates=4)]
    )
    ref = x.log_softmax(-1)
    assert out[0].top_logprobs is None and out[0].candidates is None
    top = ref[1].topk(3)
    assert [t for t, _ in out[1].top_logprobs[0]] == top.indices.tolist()
    torch.testing.assert_close(torch.tensor([v for _, v in out[1].top_logprobs[0]]), top.values)
    assert [t for t, _ in out[2].candidates] == ref[2].topk(4).indices.tolist()
    for i, r in enumerate(out):
        assert abs(r.logprobs[0] - ref[i, r.token_ids[0]].item()) < 1e-5


def test_penalties_from_token_counts_match_a_direct_count() -> None:
    from streamkv.layers.penalties import TokenCounts

    counts = TokenCounts(VOCAB, "cpu", capacity=1)  # grows on the second row
    histories = [([1, 2, 2, 3], [3, 3, 9]), ([4], [])]
    rows = [counts.allocate(p, o) for p, o in histories]
    counts.add([rows[1], rows[1], rows[0]], [4, 11, 3])  # two steps' tokens, in one call
    histories = [([1, 2, 2, 3], [3, 3, 9, 3]), ([4], [4, 11])]
    params = [(0.5, 0.25, 1.5), (-1.0, 0.0, 0.8)]
    x = logits(2, seed=9)
    want = x.clone()
    for i, ((prompt, output), (pres, freq, rep)) in enumerate(zip(histories, params)):
        for t in set(prompt + output):
            want[i, t] = want[i, t] / rep if want[i, t] > 0 else want[i, t] * rep
        for t in set(output):
            want[i, t] -= freq * output.count(t) + pres
    reqs = [
        SampleRequest(
            presence_penalty=a,
            frequency_penalty=b,
            repetition_penalty=c,
            counts=counts,
            counts_row=r,
            logprobs=VOCAB,
        )
        for (a, b, c), r in zip(params, rows)
    ]
    out = Sampler()(x.clone(), reqs)
    for i, res in enumerate(out):
        got = torch.full((VOCAB,), float("nan"))
        for t, lp in res.top_logprobs[0]:
            got[t] = lp
        torch.testing.assert_close(got, want[i].log_softmax(-1))
    counts.free(rows[0])
    assert counts.num_rows == 1 and counts.allocate([], []) == rows[0]
    assert counts.output[rows[0]].sum() == 0 and not counts.prompt[rows[0]].any()


def test_a_penalty_without_its_counts_is_an_error() -> None:
    with pytest.raises(ValueError, match="token counts"):
        Sampler()(logits(1), [SampleRequest(presence_penalty=1.0)])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_seeded_draws_are_the_same_on_cuda_and_cpu() -> None:
    from streamkv.layers.stream_hash import hashed_exponentials, stream_keys

    keys = stream_keys(list(range(8)), [0] * 8, list(range(8)))
    ids = torch.arange(128_256)
    torch.testing.assert_close(
        hashed_exponentials(keys.cuda(), ids.cuda()).cpu(), hashed_exponentials(keys, ids)
    )
    x = torch.randn(8, 1000, generator=torch.Generator().manual_seed(11)) * 3
    reqs = [SampleRequest(temperature=0.9, top_k=40, seed=s, output_pos=s) for s in range(4)]
    reqs += [SampleRequest(temperature=1.1, top_p=0.8, seed=s) for s in range(4)]
    assert _tokens(Sampler(device="cuda")(x.cuda(), reqs)) == _tokens(Sampler()(x.clone(), reqs))


def _allowed_rows(device: str) -> list[list[int]]:
    """Per row, the tokens drawn under allowed_token_ids masks, greedy and sampled, 50 steps."""
    from streamkv.layers.token_mask import mask_of

    allowed = [[3, 9, 41], [0], [49, 12]]
    sampler, drawn = Sampler(device=device), [[] for _ in allowed]
    for step in range(50):
        x = logits(4, seed=step).to(device) * 4
        reqs = [
            SampleRequest(allowed_mask=mask_of(allowed[0], VOCAB), logit_bias={5: 100.0}),  # greedy
            SampleRequest(temperature=1.0, seed=step, allowed_mask=mask_of(allowed[1], VOCAB)),
            SampleRequest(
                temperature=2.0, top_p=0.95, allowed_mask=mask_of(allowed[2], VOCAB), num_samples=2
            ),
            SampleRequest(temperature=1.0, top_k=3),  # unmasked: anything
        ]
        out = sampler(x, reqs)
        for i in range(3):
            drawn[i] += out[i].token_ids
            assert all(lp > float("-inf") for lp in out[i].logprobs)
    for i, ids in enumerate(allowed):
        assert set(drawn[i]) <= set(ids), i
    assert set(drawn[2]) == {49, 12}  # both drawn: the mask restricts, it does not pick
    return drawn


def test_allowed_token_ids_mask_every_path() -> None:
    _allowed_rows("cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_allowed_token_ids_mask_on_cuda() -> None:
    # The kernel path: the mask bans in float32 before the sampling kernel, as logit_bias does.
    _allowed_rows("cuda")
