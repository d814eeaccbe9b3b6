"""Linear projections; a merged one runs several projections of one input as one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """`y = x W^T + b`, with `W` the concatenation of `output_sizes` row blocks (shards).

    Merging q|k|v or gate|up into one weight saves kernel launches; checkpoints still hold
    the shards separately, so weights load shard by shard through `shard`.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.output_sizes = output_sizes
        self.weight = nn.Parameter(torch.empty(sum(output_sizes), input_size), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(sum(output_sizes)), requires_grad=False) if bias else None
        )

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`x` `[T, input_size]` -> `[T, sum(output_sizes)]`, written into `out` if given."""
        if out is None:
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight.t(), out=out)
        return torch.addmm(self.bias, x, self.weight.t(), out=out)

    def shard(self, param_name: str, index: int) -> torch.Tensor:
        """Row block `index` of `weight` or `bias` (a view to load into)."""
        start = sum(self.output_sizes[:index])
        return getattr(self, param_name).data[start : start + self.output_sizes[index]]
