"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from bcg.layers import triton_ops
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
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return `(norm(x + residual), x + residual)`: the new hidden state and residual.
        With the fused kernel the sum is written into `residual` in place."""
        if use_fused_kernels(x):
            return triton_ops.add_rms_norm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self(residual), residual
