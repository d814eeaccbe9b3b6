"""Gated activation of the MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bcg.layers import triton_ops
from bcg.layers.triton_ops import use_fused_kernels


class SiluAndMul(nn.Module):
    """`silu(gate) * up` for `x = gate | up` concatenated on the last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused_kernels(x):
            return triton_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
