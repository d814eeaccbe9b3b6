"""RMSNorm over the last dimension, optionally fused with the residual add before it (and with
the sum of a mixture-of-experts token's expert outputs before that); Mamba2's gated RMSNorm.

Rounding follows ``bcg.layers.norm``: RMSNorm normalises in fp32, rounds to the input dtype,
then scales by the weight, and the fused residual sum is rounded before it is normalised; the
gated norm stays in fp32 from the gate to the weight and rounds once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bcg.kernels import _pdl
from bcg.kernels._launch import (
    CachedLauncher,
    next_power_of_2,
    require_last_dim_contiguous,
)
from bcg.kernels.fused_moe import sum_choice_rows

# Elements per thread beyond which a row gets more warps.
ELEMENTS_PER_THREAD = 8
MAX_WARPS = 16


def _row_warps(block: int) -> int:
    """Warps for a program that holds a row of `block` elements."""
    return min(MAX_WARPS, max(1, block // (32 * ELEMENTS_PER_THREAD)))


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``weight * x / rms(x)`` over the last dimension.

    Args:
        x: ``[rows, hidden]`` or ``[tokens, heads, head_dim]`` (per-head q/k norm), last dim
            contiguous; other strides are free, so a view into a fused qkv tensor works.
        weight: ``[hidden]``.
        eps: added to the mean square.
        out: same shape as ``x``, last dim contiguous (allocated if None; may be ``x``).

    Returns ``out``.
    """
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    _launch(x, None, weight, eps, out)
    return out


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` in place, then ``out = rms_norm(residual)``, in one pass.

    Args:
        x, residual: ``[rows, hidden]``, same dtype, last dim contiguous.
        weight: ``[hidden]``.
        eps: added to the mean square.
        out: ``[rows, hidden]`` (allocated if None; may be ``x``).

    Returns ``(out, residual)``, matching ``RMSNorm.add_and_norm``.
    """
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    _launch(x, residual, weight, eps, out)
    return out, residual


def sum_add_rms_norm(
    rows: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm(rows.sum(dim=1), residual, weight, eps)`, the sum in fp32 rounded once
    (as `bcg.kernels.fused_moe` sums a token's top-k expert outputs), in one launch: a
    mixture-of-experts layer's last sum and the norm after it (one launch a layer fewer).

    Args:
        rows: `[tokens, k, hidden]`, contiguous.
        residual: `[tokens, hidden]`, `rows`' dtype, last dim contiguous; updated in place.
        weight: `[hidden]`.

    Returns `(out, residual)`, `out` new.
    """
    num_tokens, top_k, hidden = rows.shape
    if (residual.shape != (num_tokens, hidden) or residual.dtype != rows.dtype
            or weight.shape != (hidden,) or not rows.is_contiguous()):
        raise ValueError(
            f"sum_add_rms_norm takes contiguous rows [tokens, k, hidden], a residual [tokens, "
            f"hidden] of their dtype and a weight [hidden]; got rows {tuple(rows.shape)} "
            f"{rows.dtype}, residual {tuple(residual.shape)} {residual.dtype}, weight "
            f"{tuple(weight.shape)}")
    for name, tensor in (("residual", residual), ("weight", weight)):
        require_last_dim_contiguous(name, tensor)
    out = residual.new_empty(num_tokens, hidden)
    if num_tokens == 0:
        return out, residual
    block = next_power_of_2(hidden)
    _launch_sum_add_rms_norm(
        (num_tokens,),
        (rows, residual, weight, out),
        (float(eps),),
        {"TOP_K": top_k, "HIDDEN": hidden, "STRIDE_RES": residual.stride(0),
         "BLOCK_K": next_power_of_2(top_k), "BLOCK": block,
         "PDL": _pdl.launches_early(rows.device)},
        num_warps=_row_warps(block),
    )
    return out, residual


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
) -> None:
    if x.dim() not in (2, 3) or out.shape != x.shape or weight.shape != x.shape[-1:]:
        raise ValueError(
            f"expected x [rows, hidden] or [tokens, heads, head_dim] with out of the same shape "
            f"and weight [hidden]; got x {tuple(x.shape)}, out {tuple(out.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    for name, tensor in (("x", x), ("out", out), ("weight", weight)):
        require_last_dim_contiguous(name, tensor)
    hidden = x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    num_rows = x.numel() // hidden
    if num_rows == 0:
        return
    # Without a residual the kernel never touches its pointer; x stands in for it.
    residual_or_x = x if residual is None else residual
    require_last_dim_contiguous("residual", residual_or_x)
    block = next_power_of_2(hidden)
    x_tok, x_head = _row_strides(x)
    res_tok, res_head = _row_strides(residual_or_x)
    out_tok, out_head = _row_strides(out)
    _launch_rms_norm(
        (num_rows,),
        (x, residual_or_x, weight, out),
        (float(eps),),  # an int would be a specialised integer argument
        {
            "HIDDEN": hidden,
            "HEADS": heads,
            "STRIDE_X_TOK": x_tok,
            "STRIDE_X_HEAD": x_head,
            "STRIDE_RES_TOK": res_tok,
            "STRIDE_RES_HEAD": res_head,
            "STRIDE_OUT_TOK": out_tok,
            "STRIDE_OUT_HEAD": out_head,
            "HAS_RESIDUAL": residual is not None,
            "BLOCK": block,
            "PDL": _pdl.launches_early(x.device),
        },
        num_warps=_row_warps(block),
    )


def _row_strides(t: torch.Tensor) -> tuple[int, int]:
    """(token stride, head stride) of a 2D or 3D tensor; 2D rows have one 'head'."""
    return (t.stride(0), t.stride(1)) if t.dim() == 3 else (t.stride(0), 0)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, eps,
    HIDDEN: tl.constexpr,
    HEADS: tl.constexpr,
    STRIDE_X_TOK: tl.constexpr,
    STRIDE_X_HEAD: tl.constexpr,
    STRIDE_RES_TOK: tl.constexpr,
    STRIDE_RES_HEAD: tl.constexpr,
    STRIDE_OUT_TOK: tl.constexpr,
    STRIDE_OUT_HEAD: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    _pdl.start_after_previous(PDL)
    row = tl.program_id(0)
    token = (row // HEADS).to(tl.int64)
    head = row % HEADS
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + token * STRIDE_X_TOK + head * STRIDE_X_HEAD + cols, mask=mask,
                other=0.0)
    res_ptrs = residual_ptr + token * STRIDE_RES_TOK + head * STRIDE_RES_HEAD + cols
    out_ptrs = out_ptr + token * STRIDE_OUT_TOK + head * STRIDE_OUT_HEAD + cols
    add_rms_norm_row(x, res_ptrs, weight_ptr, out_ptrs, cols, mask, eps, HIDDEN, HAS_RESIDUAL)


@triton.jit
def add_rms_norm_row(x, res_ptrs, weight_ptr, out_ptrs, cols, mask, eps, HIDDEN: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr):
    """One row: with `HAS_RESIDUAL`, `x + residual` (rounded to x's dtype) written back
    to the residual first; then the row over its root mean square, rounded to x's dtype,
    times the weight, written to `out_ptrs`. Kernels that end in a norm share it (or
    `add_rms_norm_loaded`, given the loaded values)."""
    residual = tl.load(res_ptrs, mask=mask, other=0.0) if HAS_RESIDUAL else x
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    add_rms_norm_loaded(x, residual, weight, res_ptrs, out_ptrs, mask, eps, HIDDEN, HAS_RESIDUAL)


@triton.jit
def add_rms_norm_loaded(x, residual, weight, res_ptrs, out_ptrs, mask, eps, HIDDEN: tl.constexpr,
                        HAS_RESIDUAL: tl.constexpr):
    """`add_rms_norm_row` with the residual's and the weight's values already loaded (a
    kernel that waits for `x` loads them before it waits)."""
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(res_ptrs, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, 0) / HIDDEN + eps)
    normed = (x32 * inv_rms).to(x.dtype).to(tl.float32)
    tl.store(out_ptrs, (normed * weight.to(tl.float32)).to(out_ptrs.dtype.element_ty), mask=mask)


_launch_rms_norm = CachedLauncher(_rms_norm_kernel)


@triton.jit
def _sum_add_rms_norm_kernel(
    rows_ptr, residual_ptr, weight_ptr, out_ptr, eps,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    STRIDE_RES: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    _pdl.start_after_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = sum_choice_rows(rows_ptr, token, cols, mask, TOP_K, HIDDEN, BLOCK_K)
    x = x.to(rows_ptr.dtype.element_ty)
    add_rms_norm_row(x, residual_ptr + token * STRIDE_RES + cols, weight_ptr,
                     out_ptr + token * HIDDEN + cols, cols, mask, eps, HIDDEN, True)


_launch_sum_add_rms_norm = CachedLauncher(_sum_add_rms_norm_kernel)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group_size: int,
                   eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``weight * g / rms(g)`` with ``g = x * silu(gate)``, the rms over each group of
    ``group_size`` channels (Mamba2's output norm), in fp32 and rounded once.

    Args:
        x, gate: ``[tokens, width]``, last dim contiguous (gate may be a strided view).
        weight: ``[width]``; ``width`` a multiple of ``group_size``.
        eps: added to the mean square.
        out: ``[tokens, width]`` in ``x.dtype`` (allocated if None).

    Returns ``out``.
    """
    if x.dim() != 2 or gate.shape != x.shape or weight.shape != x.shape[-1:] \
            or x.shape[1] % group_size:
        raise ValueError(f"expected x and gate [tokens, width] and weight [width] with width a "
                         f"multiple of {group_size}; got x {tuple(x.shape)}, gate "
                         f"{tuple(gate.shape)}, weight {tuple(weight.shape)}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    for name, tensor in (("x", x), ("gate", gate), ("out", out), ("weight", weight)):
        require_last_dim_contiguous(name, tensor)
    num_tokens, width = x.shape
    if num_tokens == 0:
        return out
    block = next_power_of_2(group_size)
    _launch_gated_rms_norm(
        (num_tokens, width // group_size),
        (x, gate, weight, out),
        (float(eps),),
        {"GROUP": group_size, "STRIDE_X": x.stride(0), "STRIDE_GATE": gate.stride(0),
         "STRIDE_OUT": out.stride(0), "BLOCK": block, "PDL": _pdl.launches_early(x.device)},
        num_warps=_row_warps(block),
    )
    return out


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, gate_ptr, weight_ptr, out_ptr, eps,
    GROUP: tl.constexpr,
    STRIDE_X: tl.constexpr,
    STRIDE_GATE: tl.constexpr,
    STRIDE_OUT: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    _pdl.start_after_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * GROUP + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < GROUP
    x = tl.load(x_ptr + token * STRIDE_X + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + token * STRIDE_GATE + cols, mask=mask, other=0.0).to(tl.float32)
    gated = x * (gate * tl.sigmoid(gate))
    inv_rms = tl.rsqrt(tl.sum(gated * gated, 0) / GROUP + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * STRIDE_OUT + cols,
             (gated * inv_rms * weight).to(out_ptr.dtype.element_ty), mask=mask)


_launch_gated_rms_norm = CachedLauncher(_gated_rms_norm_kernel)
