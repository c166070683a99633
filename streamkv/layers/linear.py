"""Linear layers that know how they are sharded across tensor-parallel ranks (Megatron):
a column-parallel layer keeps a slice of the output features, a row-parallel one a slice of
the input features and sums partial results across ranks."""

from __future__ import annotations

import torch
from torch import nn

from streamkv.kernels import fused, gemv
from streamkv.layers import fp8


class ParallelLinear(nn.Module):
    """``y = x W^T + b`` holding this rank's shard.

    ``out_splits`` lists the logical outputs fused into one matrix (e.g. q, k, v): each is
    sharded separately so every rank gets whole heads of each. With ``tp_size > 1`` a
    row-parallel layer all-reduces its output and a column-parallel one with
    ``gather_output`` all-gathers it (the default process group must be initialized).

    ``quantize_fp8()`` (after the weights are loaded) swaps ``weight`` for ``weight_fp8`` and
    its per-output-channel ``weight_scale``; the products then run ``fp8.fp8_linear``.
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
        gather_output: bool = False,
    ) -> None:
        super().__init__()
        if parallel not in ("column", "row"):
            raise ValueError(f"parallel must be 'column' or 'row', got {parallel!r}")
        self.parallel, self.tp_rank, self.tp_size = parallel, tp_rank, tp_size
        self.out_splits = out_splits
        self.gather_output = gather_output
        self.has_bias = bias  # of the whole layer (a row-parallel bias lives on rank 0 only)
        # A plain flag, read on every product: hasattr on a Module raises through its
        # __getattr__ when the attribute is missing, about a microsecond a call.
        self.quantized = False
        if parallel == "column":
            if any(o % tp_size for o in out_splits):
                raise ValueError(f"output sizes {out_splits} do not divide by tp_size {tp_size}")
            out_local, in_local = sum(out_splits) // tp_size, in_features
        else:
            if in_features % tp_size:
                raise ValueError(f"in_features {in_features} does not divide by tp_size {tp_size}")
            out_local, in_local = sum(out_splits), in_features // tp_size
        # torch.empty, not nn.Linear: default init of an 8B model on the CPU takes minutes and
        # is overwritten by the checkpoint (or by dummy init) anyway.
        self.weight = nn.Parameter(
            torch.empty(out_local, in_local, dtype=dtype, device=device), requires_grad=False
        )
        # A row-parallel bias must enter the sum once: rank 0 holds it and adds it before the
        # all-reduce, so every rank ends with the same output.
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

    def _rows(self, part: int) -> slice:
        if self.parallel == "row":
            return slice(0, self.weight.shape[0])
        start = sum(self.out_splits[:part]) // self.tp_size
        return slice(start, start + self.out_splits[part] // self.tp_size)

    def load_part(self, part: int, tensor: torch.Tensor, is_bias: bool = False) -> None:
        """Copy this rank's shard of the full weight (or bias) of logical output ``part``
        into place, so a checkpoint streams in one tensor at a time."""
        if not 0 <= part < len(self.out_splits):
            raise ValueError(f"part {part} out of range for outputs {self.out_splits}")
        expected = (self.out_splits[part],) if is_bias else None
        if is_bias and tuple(tensor.shape) != expected:
            raise ValueError(f"bias shape {tuple(tensor.shape)} != expected {expected}")
        target = self.bias if is_bias else self.weight
        if target is None:
            if is_bias and self.parallel == "row":
                return  # ranks > 0 of a row-parallel layer hold no bias
            raise ValueError("this layer was built without a bias")
        dst = target.data[self._rows(part)]
        src = self.shard(tensor, part)
        if src.shape != dst.shape:
            raise ValueError(f"shard shape {tuple(src.shape)} != expected {tuple(dst.shape)}")
        dst.copy_(src)

    def load(self, weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None) -> None:
        """Load the full weights of each logical output (in ``out_splits`` order)."""
        w = torch.cat([self.shard(t, i) for i, t in enumerate(weights)], dim=0)
        if w.shape != self.weight.shape:
            raise ValueError(
                f"weight shape {tuple(w.shape)} != expected {tuple(self.weight.shape)}"
            )
        self.weight.data.copy_(w)
        if self.bias is not None:
            if biases is None:
                raise ValueError("missing bias weights")
            self.bias.data.copy_(torch.cat([self.shard(b, i) for i, b in enumerate(biases)]))

    def quantize_fp8(self) -> None:
        """Replace the loaded weight by its e4m3 copy and per-output-channel scales, and free
        it: one layer's weight is converted at a time, so a model's peak memory stays its
        unquantized size plus one layer's fp32 temporaries."""
        if self.quantized:
            raise ValueError("this layer is already quantized")
        if self.weight.is_cuda:
            fp8.check_cuda_shape(*self.weight.shape)
        q, scale = fp8.quantize_weight(self.weight.data)
        del self.weight  # the only reference: its memory returns to the allocator
        # Parameters (frozen), not buffers, so that model.parameters() counts them in the
        # weights' size the worker logs.
        self.weight_fp8 = nn.Parameter(q, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        # The unit scales of the small-batch product (fp8.fp8_linear), made once here: a
        # tensor made inside a CUDA graph's capture would live in the graph's pool.
        self.register_buffer("fp8_unit", torch.ones((), device=q.device), persistent=False)
        self.quantized = True

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's ``x W^T + b``, before any tensor-parallel reduction."""
        if self.quantized:
            return fp8.fp8_linear(x, self.weight_fp8, self.weight_scale, self.bias, self.fp8_unit)
        # gemv.linear is F.linear, with a kernel of our own for steps of a few tokens.
        return gemv.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._product(x)
        if self.tp_size == 1:
            return out
        import torch.distributed as dist

        if self.parallel == "row":
            dist.all_reduce(out)
            return out
        if not self.gather_output:
            return out
        parts = [torch.empty_like(out) for _ in range(self.tp_size)]
        dist.all_gather(parts, out.contiguous())
        # Each rank's shard holds its slice of every logical output: put outputs back whole.
        if len(self.out_splits) == 1:
            return torch.cat(parts, dim=-1)
        local = [o // self.tp_size for o in self.out_splits]
        pieces = [p.split(local, dim=-1) for p in parts]
        return torch.cat([pc[i] for i in range(len(local)) for pc in pieces], dim=-1)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of this layer's output, where the layer is a fused gate/up
        projection (two equal outputs, column-parallel, not gathered): [tokens, 2 I] is
        never written for a few tokens, the product kernel applies the activation itself."""
        if (
            self.parallel != "column"
            or self.gather_output
            or len(self.out_splits) != 2
            or self.out_splits[0] != self.out_splits[1]
        ):
            raise ValueError(
                "silu_and_mul needs a column-parallel gate/up projection of two equal outputs"
            )
        if self.quantized:
            return fused.silu_and_mul(self._product(x))
        return gemv.linear_silu_and_mul(x, self.weight, self.bias)
