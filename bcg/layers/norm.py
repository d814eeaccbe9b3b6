"""RMSNorm, optionally fused with the residual add that precedes it; Mamba2's gated RMSNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bcg.distributed.parallel_state import TensorParallel
from bcg.layers import triton_ops
from bcg.layers.linear import load_rank_blocks
from bcg.layers.triton_ops import use_fused_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused_kernels(x):
            return triton_ops.rms_norm(x, self.weight, self.eps)
        # Normalise in fp32, scale in the input dtype, as the reference implementation does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, tp: TensorParallel | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return `(norm(x + residual), x + residual)`: the new hidden state and residual
        (`(norm(x), x)` before the first layer, with no residual yet). With the fused kernel
        the sum is written into `residual` in place. With `tp`, `x` is this rank's part of a
        sum over its ranks: the all-reduce runs first, in the same kernel as the add and the
        norm where the group's custom all-reduce takes them."""
        if tp is not None and tp.size > 1:
            fused = tp.custom_all_reduce
            if residual is not None and fused is not None and fused.takes_add_rms_norm(
                    x, residual):
                return fused.add_rms_norm(x, residual, self.weight, self.eps)
            x = tp.all_reduce(x)
        if residual is None:
            return self(x), x
        if use_fused_kernels(x):
            return triton_ops.add_rms_norm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self(residual), residual


class GatedRMSNorm(nn.Module):
    """RMSNorm of `x * silu(gate)` over groups of `group_size` channels (Mamba2's output
    norm, one group per B/C group). Split across ranks by whole groups: `hidden_size` is
    the full size, each rank holds its groups' channels."""

    def __init__(self, hidden_size: int, group_size: int, eps: float, local_size: int) -> None:
        super().__init__()
        self.hidden_size, self.group_size, self.eps = hidden_size, group_size, eps
        self.weight = nn.Parameter(torch.ones(local_size), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if use_fused_kernels(x):
            return triton_ops.gated_rms_norm(x, gate, self.weight, self.group_size, self.eps)
        gated = x.float() * F.silu(gate.float())
        groups = gated.view(*gated.shape[:-1], -1, self.group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * groups.view_as(gated)).to(x.dtype)

    def load_weight(self, name: str, loaded: torch.Tensor) -> None:
        load_rank_blocks(name, self.weight.data, loaded, [self.hidden_size])
