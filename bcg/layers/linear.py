"""Linear projections, split across tensor-parallel ranks.

`ColumnParallelLinear` splits its outputs: each rank computes its part of every output
block (its heads of q, k and v, its slice of gate and up), and nothing is exchanged.
`RowParallelLinear` splits its inputs: each rank multiplies its slice and the partial
results are summed across ranks (one all-reduce). A merged projection (q|k|v, gate|up)
runs several checkpoint projections as one matmul; checkpoints hold them separately, so
weights load block by block, each rank narrowing the full tensor to its part.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from bcg.distributed.parallel_state import tensor_parallel
from bcg.layers import triton_ops
from bcg.layers.activation import activate

if TYPE_CHECKING:
    from bcg.layers.norm import RMSNorm


def check_shape(name: str, loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    """Raise naming the weight unless checkpoint tensor `name` has the `expected` (whole,
    unsplit) shape."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"weight {name!r} has shape {tuple(loaded.shape)}, the model expects "
                         f"{tuple(expected)}: does the config match the checkpoint?")


def copy_checked(name: str, target: torch.Tensor, loaded: torch.Tensor) -> None:
    check_shape(name, loaded, tuple(target.shape))
    target.copy_(loaded)


def load_rank_blocks(name: str, target: torch.Tensor, loaded: torch.Tensor,
                     block_sizes: list[int]) -> None:
    """Copy into `target` this rank's equal share of each block of `loaded` (dim 0 cut into
    `block_sizes`, the unsplit sizes), for parameters split by heads or channels."""
    tp = tensor_parallel()
    # e.g. an already split tensor: never copied as it is
    check_shape(name, loaded, (sum(block_sizes), *loaded.shape[1:]))
    parts = [piece.narrow(0, tp.rank * (size // tp.size), size // tp.size)
             for piece, size in zip(loaded.split(block_sizes), block_sizes, strict=True)]
    copy_checked(name, target, torch.cat(parts))


class Linear(nn.Module):
    """`y = x W^T + b` over this rank's weight; `output_sizes` are the full (unsplit) blocks."""

    def __init__(self, local_input: int, local_outputs: list[int], output_sizes: list[int],
                 bias: bool) -> None:
        super().__init__()
        self.output_sizes = output_sizes
        self.local_outputs = local_outputs
        self.weight = nn.Parameter(torch.empty(sum(local_outputs), local_input),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(sum(local_outputs)), requires_grad=False)
                     if bias else None)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None,
               activation: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """`x W^T + bias` (into `out` if given, with no activation), then `activation`:
        `"silu_and_mul"` of the output's halves `[gate | up]` or `"relu_squared"`."""
        return linear(x, self.weight, bias, activation, out)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x weight^T + bias` (into `out` if given, with no activation), then `activation`.
    Decode-sized steps on CUDA take the skinny kernel, the activation fused (one launch);
    the rest cuBLAS."""
    assert activation is None or out is None, "an activated projection writes a new tensor"
    if triton_ops.uses_skinny_linear(x, weight, activation):
        return triton_ops.skinny_linear(x, weight, bias, activation=activation, out=out)
    if activation is not None:
        return activate(F.linear(x, weight, bias), activation)
    if out is None:
        return F.linear(x, weight, bias)
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


class ColumnParallelLinear(Linear):
    """Block i of `output_sizes` is cut into `parts[i]` equal parts (default: one per rank);
    rank r holds part `r * parts[i] // tp`. Fewer parts than ranks replicate a part (k and
    v when there are fewer KV heads than ranks)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 parts: list[int] | None = None) -> None:
        tp = tensor_parallel()
        self.parts = parts or [tp.size] * len(output_sizes)
        for size, count in zip(output_sizes, self.parts, strict=True):
            if size % count or (tp.size % count and count % tp.size):
                raise ValueError(f"an output block of {size} cannot be split in {count} parts "
                                 f"over {tp.size} tensor-parallel ranks")
        local = [size // count for size, count in zip(output_sizes, self.parts, strict=True)]
        super().__init__(input_size, local, output_sizes, bias)
        self.rank, self.tp_size = tp.rank, tp.size

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None,
                activation: str | None = None) -> torch.Tensor:
        """`x` `[T, input_size]` -> this rank's `[T, sum(local outputs)]`, into `out` if given;
        then `activation` (`Linear.matmul`): `"silu_and_mul"` of two equal outputs gives
        `[T, local output]`."""
        return self.matmul(x, self.bias, activation, out)

    def load_weight(self, name: str, loaded: torch.Tensor, block: int | None = None) -> None:
        """Copy this rank's part of checkpoint tensor `name`: output block `block`, or, with
        no block named, every block of a checkpoint tensor that holds them all (Mamba2's
        in_proj: z | x | B | C | dt in one tensor)."""
        if block is None:
            if len(self.output_sizes) > 1 and loaded.shape[0] == sum(self.output_sizes):
                for index, piece in enumerate(loaded.split(self.output_sizes)):
                    self.load_weight(name, piece, index)
                return
            block = 0
        param_name = name.rpartition(".")[2]
        length = self.local_outputs[block]
        part = self.rank * self.parts[block] // self.tp_size
        start = sum(self.local_outputs[:block])
        target = getattr(self, param_name).data[start : start + length]
        check_shape(name, loaded, (self.output_sizes[block], *target.shape[1:]))
        target.copy_(loaded.narrow(0, part * length, length))

    def fill_dummy(self, name: str, draw: Callable[..., torch.Tensor]) -> None:
        """Random weights (`draw(shape, part)`) as a checkpoint would hold them, this rank's
        part kept: each output block whole."""
        width = () if name.endswith(".bias") else (self.weight.shape[1],)
        for block, size in enumerate(self.output_sizes):
            self.load_weight(name, draw((size, *width), block), block)


class RowParallelLinear(Linear):
    """Each rank multiplies its slice of the inputs; the ranks' results are summed."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp = tensor_parallel()
        start, local_input = tp.shard(input_size, "a row-parallel projection's input")
        super().__init__(local_input, [output_size], [output_size], bias)
        self.tp, self.input_start, self.input_size = tp, start, input_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `[T, local input]` -> `[T, output_size]`, the same on every rank."""
        if self.tp.size == 1:  # one kernel, the bias fused
            return self.matmul(x, self.bias)
        y = self.tp.all_reduce(self.matmul(x, None))  # the bias added once, after the sum
        return y if self.bias is None else y + self.bias

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                     norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """`norm.add_and_norm(self(x), residual)`; without a bias the ranks' sum is left to
        the norm, which runs the all-reduce, the add and the norm as one kernel where it can,
        or, for decode-sized steps on the skinny kernel, to the group's custom all-reduce: the
        projection sends its output tiles to every rank as it goes, and one kernel after it
        sums them, adds and normalises."""
        if self.bias is not None:
            return norm.add_and_norm(self(x), residual)
        # The kernel reads `self.weight` as is and norms as RMSNorm does: plain weights only.
        fused = self.tp.custom_all_reduce if self.tp.size > 1 else None
        if (residual is not None and fused is not None
                and triton_ops.uses_skinny_linear(x, self.weight)
                and fused.takes_projection_add_rms_norm(x, self.weight, residual)):
            return fused.projection_add_rms_norm(x, self.weight, residual, norm.weight, norm.eps)
        return norm.add_and_norm(self.matmul(x, None), residual, self.tp)

    def load_weight(self, name: str, loaded: torch.Tensor) -> None:
        """Copy this rank's input columns of checkpoint tensor `name` (a bias whole)."""
        param_name = name.rpartition(".")[2]
        if param_name == "weight":
            check_shape(name, loaded, (self.weight.shape[0], self.input_size))
            loaded = loaded.narrow(1, self.input_start, self.weight.shape[1])
        copy_checked(name, getattr(self, param_name).data, loaded)

    def fill_dummy(self, name: str, draw: Callable[..., torch.Tensor]) -> None:
        """Random weights (`draw(shape)`) as a checkpoint would hold them, this rank's input
        columns kept."""
        output_size = self.weight.shape[0]
        self.load_weight(name, draw((output_size,) if name.endswith(".bias")
                                    else (output_size, self.input_size)))
