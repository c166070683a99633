"""Linear layers that know how they are sharded across tensor-parallel ranks (Megatron):
a column-parallel layer keeps a slice of the output features, a row-parallel one a slice of
the input features and sums partial results across ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ParallelLinear(nn.Module):
    """``y = x W^T + b`` holding this rank's shard.

    ``out_splits`` lists the logical outputs fused into one matrix (e.g. q, k, v): each is
    sharded separately so every rank gets whole heads of each.
    """

    def __init__(
        self,
        in_features: int,
        out_splits: list[int],
        bias: bool = False,
        parallel: str = "column",
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        if parallel not in ("column", "row"):
            raise ValueError(f"parallel must be 'column' or 'row', got {parallel!r}")
        self.parallel, self.tp_rank, self.tp_size = parallel, tp_rank, tp_size
        self.out_splits = out_splits
        if parallel == "column":
            if any(o % tp_size for o in out_splits):
                raise ValueError(f"output sizes {out_splits} do not divide by tp_size {tp_size}")
            out_local, in_local = sum(out_splits) // tp_size, in_features
        else:
            if in_features % tp_size:
                raise ValueError(f"in_features {in_features} does not divide by tp_size {tp_size}")
            out_local, in_local = sum(out_splits), in_features // tp_size
        self.weight = nn.Parameter(
            torch.empty(out_local, in_local, dtype=dtype, device=device), requires_grad=False
        )
        # Row-parallel bias is added once, after the reduction (rank 0 holds it).
        has_bias = bias and (parallel == "column" or tp_rank == 0)
        self.bias = (
            nn.Parameter(torch.empty(out_local, dtype=dtype, device=device), requires_grad=False)
            if has_bias
            else None
        )

    def shard(self, full: torch.Tensor, part: int = 0) -> torch.Tensor:
        """This rank's slice of a full (unsharded) weight or bias of logical output ``part``."""
        if self.parallel == "column":
            size = full.shape[0] // self.tp_size
            return full[self.tp_rank * size : (self.tp_rank + 1) * size]
        if full.dim() == 1:
            return full
        size = full.shape[1] // self.tp_size
        return full[:, self.tp_rank * size : (self.tp_rank + 1) * size]

    def load(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None) -> None:
        """Load the full weights of each logical output (in ``out_splits`` order)."""
        w = torch.cat([self.shard(t, i) for i, t in enumerate(weights)], dim=0)
        if w.shape != self.weight.shape:
            raise ValueError(f"weight shape {tuple(w.shape)} != expected {tuple(self.weight.shape)}")
        self.weight.data.copy_(w)
        if self.bias is not None:
            if biases is None:
                raise ValueError("missing bias weights")
            self.bias.data.copy_(torch.cat([self.shard(b, i) for i, b in enumerate(biases)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
