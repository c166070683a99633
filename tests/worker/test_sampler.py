"""The sampler on hand-made logits: logit bias, and parameters past the vocabulary."""

from __future__ import annotations

import torch

from streamkv.layers.sampler import Sampler
from streamkv.worker.messages import SampleRequest

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
        x.clone(), [SampleRequest(temperature=0.8, seed=9, top_k=10**6), SampleRequest(logprobs=VOCAB + 5)]
    )
    assert got[0].token_ids == want[0].token_ids
    assert len(got[1].top_logprobs[0]) == VOCAB
