"""Faults for worker processes under test, installed at interpreter start when this folder is
on PYTHONPATH and $STREAMKV_TEST_FAULTS names them (comma-separated). Never on the path
outside tests/executor.

- ``sampler``: rank 0's sampler raises for a request seeded POISON_SEED (after every
  collective of the step: the other ranks finish it normally).
- ``forward``: every rank's model runner (its forward pass) raises on a step that computes
  POISON_TOKEN.
- ``forward-rank1``: only ranks that do not sample raise on it (rank 0 is then left waiting
  in a collective: the ranks diverge).
"""

import os

POISON_SEED = 666
POISON_TOKEN = 999

_FAULTS = set(filter(None, os.environ.get("STREAMKV_TEST_FAULTS", "").split(",")))


def _install() -> None:
    if "sampler" in _FAULTS:
        from streamkv.layers.sampler import Sampler

        real_call = Sampler.__call__

        def call(self, logits, reqs):
            if (reqs.seeded & (reqs.seed == POISON_SEED)).any():  # SamplingRows' columns
                raise IndexError("a bug in the sampler")
            return real_call(self, logits, reqs)

        Sampler.__call__ = call
    if _FAULTS & {"forward", "forward-rank1"}:
        from streamkv.worker.model_runner import ModelRunner

        real_forward = ModelRunner.forward

        def forward(self, seqs, *args, **kwargs):
            poisoned = any(POISON_TOKEN in s.token_ids for s in seqs)
            if poisoned and ("forward" in _FAULTS or not self.samples):
                raise RuntimeError("a bug in the model")
            return real_forward(self, seqs, *args, **kwargs)

        ModelRunner.forward = forward


if _FAULTS:
    _install()
