from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype=torch.float32, device="cpu") -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like the reference implementations, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm with frozen parameters built on the target device (OPT); computed like
    ``nn.LayerNorm`` so outputs match the reference in every dtype."""

    def __init__(
        self, hidden_size: int, eps: float, affine: bool = True, dtype=torch.float32, device="cpu"
    ) -> None:
        super().__init__()
        self.eps, self.shape = eps, (hidden_size,)
        self.weight = self.bias = None
        if affine:
            self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
            self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.shape, self.weight, self.bias, self.eps)
