"""The MLP activations in one pass: SiLU-and-mul (Llama/Qwen), squared ReLU (NemotronH)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bcg.kernels._launch import (
    CachedLauncher,
    require_last_dim_contiguous,
)
from bcg.utils import cdiv

BLOCK = 1024


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]``, computed in fp32.

    Args:
        x: ``[num_tokens, 2 * intermediate]``, last dim contiguous.
        out: ``[num_tokens, intermediate]`` in ``x.dtype`` (allocated if None).

    Returns ``out``.
    """
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [num_tokens, 2 * intermediate], got {tuple(x.shape)}")
    num_tokens, width = x.shape
    intermediate = width // 2
    if out is None:
        out = x.new_empty(num_tokens, intermediate)
    require_last_dim_contiguous("x", x)
    require_last_dim_contiguous("out", out)
    if num_tokens == 0:
        return out
    _launch_silu_and_mul(
        (num_tokens, cdiv(intermediate, BLOCK)),
        (x, out),
        (),
        {"INTERMEDIATE": intermediate, "STRIDE_X": x.stride(0), "STRIDE_OUT": out.stride(0),
         "BLOCK": BLOCK},
    )
    return out


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr,
    INTERMEDIATE: tl.constexpr,
    STRIDE_X: tl.constexpr,
    STRIDE_OUT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    gate = tl.load(x_ptr + token * STRIDE_X + cols, mask=mask).to(tl.float32)
    up = tl.load(x_ptr + token * STRIDE_X + INTERMEDIATE + cols, mask=mask).to(tl.float32)
    result = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + token * STRIDE_OUT + cols, result.to(out_ptr.dtype.element_ty), mask=mask)


_launch_silu_and_mul = CachedLauncher(_silu_and_mul_kernel)


def relu_squared(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``relu(x) ** 2``, computed in fp32 and rounded once (as PyTorch's bf16 ops round).

    Args:
        x: ``[num_tokens, width]``, last dim contiguous.
        out: like ``x`` (allocated if None; may be ``x``: the MLP squares in place).

    Returns ``out``.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [num_tokens, width], got {tuple(x.shape)}")
    out = torch.empty_like(x) if out is None else out
    if out.shape != x.shape:
        raise ValueError(f"out {tuple(out.shape)} must match x {tuple(x.shape)}")
    require_last_dim_contiguous("x", x)
    require_last_dim_contiguous("out", out)
    num_tokens, width = x.shape
    if num_tokens == 0:
        return out
    _launch_relu_squared(
        (num_tokens, cdiv(width, BLOCK)),
        (x, out),
        (),
        {"WIDTH": width, "STRIDE_X": x.stride(0), "STRIDE_OUT": out.stride(0), "BLOCK": BLOCK},
    )
    return out


@triton.jit
def _relu_squared_kernel(
    x_ptr, out_ptr,
    WIDTH: tl.constexpr,
    STRIDE_X: tl.constexpr,
    STRIDE_OUT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < WIDTH
    x = tl.maximum(tl.load(x_ptr + token * STRIDE_X + cols, mask=mask).to(tl.float32), 0.0)
    tl.store(out_ptr + token * STRIDE_OUT + cols, (x * x).to(out_ptr.dtype.element_ty), mask=mask)


_launch_relu_squared = CachedLauncher(_relu_squared_kernel)
