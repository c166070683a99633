"""Pending input tokens at tensor-parallel size > 1 (async scheduling).

A step planned while the step before is still sampling carries PENDING_TOKEN for each
sequence's input (messages.py); the worker takes the real token on the device from the
step before's samples (worker/model_runner.py). Only rank 0 samples, so the other ranks
have no samples to take it from: rank 0 sends them the tokens, on the device, through the
tensor-parallel group (NCCL on GPUs, gloo on CPUs).

Only when a step needs them, and only those it needs: every rank sees the same StepInput, so
every rank knows that this step has ``n`` pending rows, and in which order, without asking
the others. Rank 0 gathers those ``n`` tokens in row order and broadcasts them; the others
receive ``n`` tokens into a buffer of their own. Nothing waits on the host: on NCCL the
broadcast is queued on the stream behind the sampler that produced the tokens.

Every rank must make the same collective calls in the same order, so rank 0 always takes
part, even when it has no tokens to send: when its step before failed, the tokens were never
sampled and ``send_placeholders`` stands in (their requests end with that failure; the
engine discards what this step computes for them).
"""

from __future__ import annotations

import torch


class TokenBroadcast:
    """Rank 0's pending tokens to every rank of the default process group (the TP group)."""

    __slots__ = ("rank", "device")

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank, self.device = rank, device

    def __call__(self, tokens: torch.Tensor | None, n: int) -> torch.Tensor:
        """Rank 0: send ``tokens`` (``n`` token ids on the device) and return them; any other
        rank: pass None and get rank 0's ``n`` tokens."""
        import torch.distributed as dist

        if self.rank == 0:
            if tokens is None or tokens.numel() != n:
                raise ValueError(f"rank 0 must send the {n} pending tokens it was asked for")
            buf = tokens.to(torch.long).contiguous()
        else:
            buf = torch.empty(n, dtype=torch.long, device=self.device)
        dist.broadcast(buf, src=0)
        return buf

    def send_placeholders(self, n: int) -> None:
        """Rank 0, whose step before failed: the same call as ``__call__``, with token 0s."""
        self(torch.zeros(n, dtype=torch.long, device=self.device), n)
