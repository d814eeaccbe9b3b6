"""Linear layers of decode-sized steps (at most `MAX_ROWS` rows): `x @ weight.T (+ bias)`
in one launch, optionally with SiLU-and-mul fused on the input.

With a few rows a linear layer only streams its weight, so its time is the weight's bytes
over the memory bandwidth plus the cost of each launch. cuBLAS splits K for such shapes and
sums the parts in a second kernel (on two H100s, qwen3-8b's o projection at tp2 takes 11.8
µs plus a 1.7 µs reduction against 5.6 µs of weight reads). Here each program owns
`block_n` output columns and reads the whole K for them: enough programs to fill the GPU for
the projections of 1B-and-up models, one launch, no workspace. The MLP's down projection can
take `[gate | up]` and apply SiLU-and-mul as it loads its input (`gated=True`), which saves
the activation's own launch and its round trip through memory. The layers choose it in
`bcg.layers.triton_ops.uses_skinny_linear`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from bcg.kernels._launch import (
    CachedLauncher,
    DeviceConfigs,
    multiprocessor_count,
    require_last_dim_contiguous,
)
from bcg.utils import cdiv

MAX_ROWS = 16  # the smallest tile tl.dot multiplies; more rows go to cuBLAS


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int  # output columns per program
    block_k: int  # K per loop step
    num_warps: int
    num_stages: int


# GPU default: a first guess, to be replaced by `bench/bench_skinny_linear.py --tune`.
CONFIGS = DeviceConfigs(gpu=SkinnyConfig(16, 256, 4, 4),
                        interpreter=SkinnyConfig(16, 16, 1, 1))


def fills_device(weight: torch.Tensor) -> bool:
    """Whether `weight` has the output columns to give every multiprocessor a program:
    fewer programs cannot stream the weight at full speed without splitting K."""
    programs = cdiv(weight.shape[0], CONFIGS.for_device(weight.is_cuda).block_n)
    return programs >= multiprocessor_count(weight.device)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  gated: bool = False, out: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None) -> torch.Tensor:
    """`x @ weight.T + bias`, or with `gated` `silu(gate) * up` of `x = [gate | up]` first
    (computed in fp32 and rounded to `x`'s dtype, as `silu_and_mul` does).

    Args:
        x: `[rows, K]` (`[rows, 2K]` if gated), rows <= MAX_ROWS, last dim contiguous.
        weight: `[N, K]`, last dim contiguous, `x`'s dtype.
        bias: `[N]` or None.
        out: `[rows, N]` (allocated if None).
        config: tiles and launch options (default: `CONFIGS` for the device).

    Returns `out`.
    """
    rows, width = x.shape
    n, k = weight.shape
    if rows > MAX_ROWS or width != (2 * k if gated else k) or x.dtype != weight.dtype:
        raise ValueError(
            f"skinny_linear takes at most {MAX_ROWS} rows of {'2K' if gated else 'K'} "
            f"columns in weight's dtype for a weight [N, K]; got x {tuple(x.shape)} "
            f"{x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    out = x.new_empty(rows, n) if out is None else out
    for name, tensor in (("x", x), ("weight", weight), ("out", out)):
        require_last_dim_contiguous(name, tensor)
    if rows == 0:
        return out
    config = config or CONFIGS.for_device(x.is_cuda)
    tensors = (x, weight, out, out if bias is None else bias)  # out: a bias never read
    _launch(
        (cdiv(n, config.block_n),),
        tensors,
        (rows,),
        {"N": n, "K": k, "STRIDE_X": x.stride(0), "STRIDE_W": weight.stride(0),
         "STRIDE_OUT": out.stride(0), "GATED": gated, "HAS_BIAS": bias is not None,
         "EVEN_N": n % config.block_n == 0, "EVEN_K": k % config.block_k == 0,
         # fp32 (CPU tests) multiplies exactly; bf16 and fp16 use the tensor cores either way
         "PRECISION": "ieee" if x.dtype == torch.float32 else "tf32",
         "BLOCK_M": MAX_ROWS, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k},
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


@triton.jit(do_not_specialize=["num_rows"])
def _skinny_linear_kernel(
    x_ptr, w_ptr, out_ptr, bias_ptr,
    num_rows,
    N: tl.constexpr,
    K: tl.constexpr,
    STRIDE_X: tl.constexpr,
    STRIDE_W: tl.constexpr,
    STRIDE_OUT: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < num_rows
    col_mask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        x_mask = row_mask[:, None] & (ks < K)[None, :]  # a few rows: masks cost nothing
        x_ptrs = x_ptr + rows[:, None] * STRIDE_X + ks[None, :]
        a = tl.load(x_ptrs, mask=x_mask, other=0.0)
        if GATED:
            gate = a.to(tl.float32)
            up = tl.load(x_ptrs + K, mask=x_mask, other=0.0).to(tl.float32)
            a = (gate * tl.sigmoid(gate) * up).to(w_ptr.dtype.element_ty)
        w_ptrs = w_ptr + cols[:, None] * STRIDE_W + ks[None, :]
        if EVEN_N and EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=col_mask[:, None] & (ks < K)[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows[:, None] * STRIDE_OUT + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


_launch = CachedLauncher(_skinny_linear_kernel)
