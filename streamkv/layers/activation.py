"""The gated MLP activation of the Llama family: ``silu(gate) * up`` over the fused
gate/up projection's output, one kernel on CUDA (``kernels/fused.py``)."""

from __future__ import annotations

import torch
from torch import nn

from streamkv.kernels import fused


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, 2 * inter] (gate | up) -> [tokens, inter]."""
        return fused.silu_and_mul(x)
