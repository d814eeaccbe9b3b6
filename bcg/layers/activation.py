"""The MLPs' activations: SiLU-and-mul (gated, Llama/Qwen) and squared ReLU (NemotronH)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bcg.layers import triton_ops
from bcg.layers.triton_ops import use_fused_kernels


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `x = gate | up` concatenated on the last dimension."""
    if use_fused_kernels(x):
        return triton_ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """`relu(x) ** 2`; on the fused kernel in place (`x` is the up projection's output, read
    by nothing else)."""
    if use_fused_kernels(x):
        return triton_ops.relu_squared(x, out=x)
    return torch.relu(x).square()


def activate(x: torch.Tensor, activation: str) -> torch.Tensor:
    """`x` through the MLP activation named, `"silu_and_mul"` or `"relu_squared"` (the
    skinny kernel's `ACTIVATIONS`; on CUDA the latter squares `x` in place)."""
    if activation == "silu_and_mul":
        return silu_and_mul(x)
    if activation == "relu_squared":
        return relu_squared(x)
    raise ValueError(f"unknown activation {activation!r}: 'silu_and_mul' or 'relu_squared'")
