"""The MLPs' activations: SiLU-and-mul (gated, Llama/Qwen) and squared ReLU (NemotronH)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bcg.layers import triton_ops
from bcg.layers.triton_ops import use_fused_kernels


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `x = gate | up` concatenated on the last dimension."""
    if use_fused_kernels(x):
        return triton_ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class ReluSquared(nn.Module):
    """`relu(x) ** 2`; on the fused kernel in place (`x` is the up projection's output, read
    by nothing else)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused_kernels(x):
            return triton_ops.relu_squared(x, out=x)
        return torch.relu(x).square()
