"""RMSNorm (Llama family) and LayerNorm (OPT) with frozen parameters.

Called with a ``residual`` they add it first, fused (``kernels/fused.py``): ``residual += x``,
then ``x = norm(residual)``, both in place, and return ``(x, residual)`` — the decoder layers
carry their residual stream through the norms as vLLM's do, so no separate add runs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from streamkv.kernels import fused


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype=torch.float32, device="cpu") -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return fused.rms_norm(x, self.weight, self.eps)
        fused.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual


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
            self.weight = nn.Parameter(
                torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False
            )
            self.bias = nn.Parameter(
                torch.zeros(hidden_size, dtype=dtype, device=device), requires_grad=False
            )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # torch's layer_norm is already one kernel
            return F.layer_norm(x, self.shape, self.weight, self.bias, self.eps)
        fused.fused_add_layer_norm(x, residual, self.weight, self.bias, self.eps)
        return x, residual
