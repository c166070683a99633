"""The Alpaca-shaped synthetic workload: seeded, and its lengths match the means the paper
publishes for Alpaca (Fig 11b: 19.31 input, 58.45 output tokens)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from load_tests import workloads


class CharTokenizer:
    """One token per character: enough to cut real text to drawn lengths."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1000 + ord(c) % 3000 for c in text]


def test_alpaca_lengths_match_the_published_means_and_are_seeded():
    reqs = workloads.alpaca(CharTokenizer(), 2000, random.Random(0))
    ins = np.array([r.prompt_len for r in reqs])
    outs = np.array([r.output_len for r in reqs])
    assert ins.mean() == pytest.approx(workloads.ALPACA_MEAN_INPUT, rel=0.05)
    assert outs.mean() == pytest.approx(workloads.ALPACA_MEAN_OUTPUT, rel=0.05)
    assert ins.min() >= workloads.ALPACA_MIN_LEN and outs.max() <= workloads.ALPACA_MAX_OUTPUT
    assert np.percentile(outs, 90) > 2 * np.median(outs)  # the long output tail
    few = workloads.alpaca(CharTokenizer(), 200, random.Random(0))
    again = workloads.alpaca(CharTokenizer(), 200, random.Random(0))
    assert [(r.prompt_ids, r.output_len) for r in again] == [
        (r.prompt_ids, r.output_len) for r in few
    ]
    other = workloads.alpaca(CharTokenizer(), 200, random.Random(1))
    assert [r.output_len for r in other] != [r.output_len for r in few]
