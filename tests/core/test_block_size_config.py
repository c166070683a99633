"""block_size: every power of two from 1 to 256 is accepted, anything else refused by name, in
the config and on the command line (no torch needed)."""

from __future__ import annotations

import argparse

import pytest

from streamkv.config import BLOCK_SIZES, CacheConfig
from streamkv.entrypoints.args import add_engine_args


def test_the_sweep_is_every_power_of_two_to_256() -> None:
    assert BLOCK_SIZES == tuple(2**i for i in range(9))


@pytest.mark.parametrize("block", BLOCK_SIZES)
def test_accepted(block: int) -> None:
    CacheConfig(block_size=block).verify()


@pytest.mark.parametrize("block", [0, -16, 3, 12, 48, 512, True, 16.0, "16"])
def test_refused_with_a_message_naming_block_size(block) -> None:
    with pytest.raises(ValueError, match=r"block_size must be a power of two from 1 to 256"):
        CacheConfig(block_size=block).verify()


def test_cli_offers_the_same_sizes() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--block-size", "256"]).block_size == 256
    assert parser.parse_args(["--block-size", "1"]).block_size == 1
    with pytest.raises(SystemExit):
        parser.parse_args(["--block-size", "24"])
