"""Linear layers of decode-sized steps (at most `MAX_ROWS` rows): `x @ weight.T (+ bias)`
in one launch, optionally with the MLP's activation fused on the output.

With a few rows a linear layer only streams its weight, so its time is the weight's bytes
over the memory bandwidth plus the cost of each launch. cuBLAS splits K for such shapes and
sums the parts in a second kernel (on two H100s, qwen3-8b's o projection at tp2 takes 11.8
µs plus a 1.7 µs reduction against 5.6 µs of weight reads). Here each program owns
`block_n` output columns and reads the whole K for them: enough programs to fill the GPU for
the projections of 1B-and-up models, one launch, no workspace. The MLP's first projection
applies its activation as it writes its output: SiLU-and-mul of the gate/up projection's two
halves (`activation="silu_and_mul"`: a program owns the same columns of both) or NemotronH's
squared ReLU (`"relu_squared"`), which saves the activation's own launch and a round trip
through memory. (Fusing it into the down projection's input instead, recomputed by every program,
ran 6-7x slower than cuBLAS on an H200.) Under tensor parallelism a row-parallel projection
can instead send its output tiles to every rank for the all-reduce, add and norm after it
(`projection_all_reduce_add_rms_norm`). The layers choose the kernel in
`bcg.layers.triton_ops.uses_skinny_linear`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from bcg.kernels import _pdl
from bcg.kernels._launch import (
    CachedLauncher,
    DeviceConfigs,
    multiprocessor_count,
    require_last_dim_contiguous,
)
from bcg.kernels.all_reduce_norm import (
    EPOCH_MASK,
    PeerRows,
    fitting,
    gathered_add_rms_norm,
    send_tile,
)
from bcg.utils import cdiv

MAX_ROWS = 16  # the smallest tile tl.dot multiplies; more rows go to cuBLAS
# What the kernel can apply to its output; "silu_and_mul" halves it (`[gate | up]`).
ACTIVATIONS = (None, "silu_and_mul", "relu_squared")


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int  # output columns per program
    block_k: int  # K per loop step
    num_warps: int
    num_stages: int


# GPU default: the best of `bench/bench_skinny_linear.py --tune` on most of qwen3-8b's
# projections (tp1 and tp2) on an H200.
CONFIGS = DeviceConfigs(gpu=SkinnyConfig(32, 256, 4, 4),
                        interpreter=SkinnyConfig(16, 16, 1, 1))


def fills_device(weight: torch.Tensor, activation: str | None = None) -> bool:
    """Whether `weight` has the output columns to give half the multiprocessors a program
    (under SiLU-and-mul one reads two weight tiles per program): fewer programs cannot
    stream the weight at full speed without splitting K. On an H200, 96 programs still beat
    cuBLAS and 64 did not."""
    columns = weight.shape[0] // (2 if activation == "silu_and_mul" else 1)
    programs = cdiv(columns, CONFIGS.for_device(weight.is_cuda).block_n)
    return 2 * programs >= multiprocessor_count(weight.device)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  activation: str | None = None, out: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None) -> torch.Tensor:
    """`act(x @ weight.T + bias)`, the activation on the fp32 sums, then rounded to `x`'s
    dtype: none, `"silu_and_mul"` (`silu(gate) * up` of the output's halves `[gate | up]`)
    or `"relu_squared"` (`relu(y) ** 2`).

    Args:
        x: `[rows, K]`, rows <= MAX_ROWS, last dim contiguous.
        weight: `[N, K]` (`[2N, K]`, the gate's rows then the up's, under SiLU-and-mul),
            last dim contiguous, `x`'s dtype.
        bias: `[N]` (`[2N]` under SiLU-and-mul) or None.
        out: `[rows, N]` (allocated if None).
        config: tiles and launch options (default: `CONFIGS` for the device).

    Returns `out`.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    gated = activation == "silu_and_mul"
    _check_operands("skinny_linear", x, weight, gated)
    weight_rows = weight.shape[0]
    if bias is not None and bias.shape != (weight_rows,):
        raise ValueError(f"bias must be [{weight_rows}], got {tuple(bias.shape)}")
    out = x.new_empty(x.shape[0], _out_columns(weight, gated)) if out is None else out
    require_last_dim_contiguous("out", out)
    if x.shape[0] == 0:
        return out
    _run(x, weight, bias, activation, out, config or CONFIGS.for_device(x.is_cuda), None)
    return out


def projection_all_reduce_add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
    eps: float, peers: PeerRows,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`all_reduce_add_rms_norm(x @ weight.T, residual, norm_weight, eps, peers)` of a
    row-parallel projection, in two launches: each program of the projection sends its
    output columns straight into every rank's slot for this rank
    (`bcg.kernels.all_reduce_norm.send_tile`) as it finishes, so the parts cross NVLink
    while the others still run, and `gathered_add_rms_norm` then only waits for the parts,
    sums, adds and normalises. Everything is checked before the send: a part sent without
    its reduce would leave the slots full for a later call. Every rank of `peers` must make
    the same calls.

    Args:
        x: `[rows, K]`, rows at most MAX_ROWS, last dim contiguous.
        weight: `[N, K]`, `x`'s dtype, last dim contiguous.
        residual: `[rows, N]`, `x`'s dtype, `peers.takes(residual)`; updated in place.
        norm_weight: `[N]`.

    Returns `(out, residual)`, `out` new.
    """
    _check_operands("projection_all_reduce_add_rms_norm", x, weight, gated=False)
    rows, n = x.shape[0], weight.shape[0]
    if residual.shape != (rows, n) or residual.dtype != x.dtype or not peers.takes(residual) \
            or norm_weight.shape != (n,):
        raise ValueError(
            f"projection_all_reduce_add_rms_norm takes residual [rows, N] of x's dtype and "
            f"{fitting(peers)}, and norm_weight [N]; got x {tuple(x.shape)} {x.dtype}, weight "
            f"{tuple(weight.shape)}, residual {tuple(residual.shape)} {residual.dtype}, "
            f"norm_weight {tuple(norm_weight.shape)}")
    _run(x, weight, None, None, x, CONFIGS.for_device(x.is_cuda), peers)
    return gathered_add_rms_norm(residual, norm_weight, eps, peers)


def _check_operands(caller: str, x: torch.Tensor, weight: torch.Tensor, gated: bool) -> None:
    """`x` `[rows, K]` (rows at most MAX_ROWS) and `weight` `[N, K]` (`[2N, K]` gated) of
    one dtype, last dims contiguous."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[0] > MAX_ROWS \
            or x.shape[1] != weight.shape[1] or x.dtype != weight.dtype \
            or (gated and weight.shape[0] % 2):
        raise ValueError(
            f"{caller} takes at most {MAX_ROWS} rows of K columns in weight's dtype for a "
            f"weight [N, K] ([2N, K] under SiLU-and-mul); got x {tuple(x.shape)} {x.dtype}, "
            f"weight {tuple(weight.shape)} {weight.dtype}")
    for name, tensor in (("x", x), ("weight", weight)):
        require_last_dim_contiguous(name, tensor)


def _out_columns(weight: torch.Tensor, gated: bool) -> int:
    """N: the output's columns (SiLU-and-mul halves the weight's `[gate | up]` rows)."""
    return weight.shape[0] // 2 if gated else weight.shape[0]


def _run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         activation: str | None, out: torch.Tensor, config: SkinnyConfig,
         peers: PeerRows | None) -> None:
    """Launch the kernel: into `out`, or (`peers`) into every rank's slot for this rank
    (then `out` is only a placeholder: the kernel stores nothing there)."""
    gated = activation == "silu_and_mul"
    n = _out_columns(weight, gated)
    sends = peers is not None
    # `out` also stands for the pointers a launch never reads (no bias, no peers).
    tensors = (x, weight, out, out if bias is None else bias,
               peers.data_ptrs if sends else out, peers.epochs if sends else out)
    _launch(
        (cdiv(n, config.block_n),),
        tensors,
        (x.shape[0],),
        {"N": n, "K": weight.shape[1], "STRIDE_X": x.stride(0), "STRIDE_W": weight.stride(0),
         "STRIDE_OUT": out.stride(0), "GATED": gated,
         "RELU_SQUARED": activation == "relu_squared", "HAS_BIAS": bias is not None,
         "EVEN_N": n % config.block_n == 0, "EVEN_K": weight.shape[1] % config.block_k == 0,
         # fp32 (CPU tests) multiplies exactly; bf16 and fp16 use the tensor cores either way
         "PRECISION": "ieee" if x.dtype == torch.float32 else "tf32",
         "SEND": sends, "RANK": peers.rank if sends else 0,
         "WORLD": peers.world_size if sends else 1,
         "ROW_NUMEL": peers.row_numel if sends else 0,
         "SLOT_NUMEL": peers.row_numel * peers.max_rows if sends else 0,
         "EPOCH_MASK": EPOCH_MASK, "PDL": _pdl.launches_early(x.device),
         "BLOCK_M": MAX_ROWS, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k},
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


@triton.jit(do_not_specialize=["num_rows"])
def _skinny_linear_kernel(
    x_ptr, w_ptr, out_ptr, bias_ptr, data_ptrs, epochs_ptr,
    num_rows,
    N: tl.constexpr,
    K: tl.constexpr,
    STRIDE_X: tl.constexpr,
    STRIDE_W: tl.constexpr,
    STRIDE_OUT: tl.constexpr,
    GATED: tl.constexpr,
    RELU_SQUARED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    SEND: tl.constexpr,  # into every rank's slot (send_tile), not out_ptr
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    ROW_NUMEL: tl.constexpr,
    SLOT_NUMEL: tl.constexpr,
    EPOCH_MASK: tl.constexpr,
    PDL: tl.constexpr,  # launched early: wait for the kernel ahead; the next starts after the loop
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < num_rows
    col_mask = cols < N
    _pdl.wait_for_previous(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # the up half's, if gated
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        x_mask = row_mask[:, None] & (ks < K)[None, :]  # a few rows: masks cost nothing
        a = tl.load(x_ptr + rows[:, None] * STRIDE_X + ks[None, :], mask=x_mask, other=0.0)
        w_ptrs = w_ptr + cols[:, None] * STRIDE_W + ks[None, :]
        w_mask = col_mask[:, None] & (ks < K)[None, :]
        acc = tl.dot(a, tl.trans(_load_tile(w_ptrs, w_mask, EVEN_N and EVEN_K)), acc,
                     input_precision=PRECISION)
        if GATED:
            up = _load_tile(w_ptrs + N * STRIDE_W, w_mask, EVEN_N and EVEN_K)
            acc_up = tl.dot(a, tl.trans(up), acc_up, input_precision=PRECISION)
    _pdl.launch_dependents(PDL)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_ptr + N + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if RELU_SQUARED:
        acc = tl.maximum(acc, 0.0)
        acc = acc * acc
    if SEND:
        send_tile(acc.to(x_ptr.dtype.element_ty), rows, cols, row_mask, col_mask, data_ptrs,
                  epochs_ptr, RANK, WORLD, ROW_NUMEL, SLOT_NUMEL, EPOCH_MASK)
    else:
        out_ptrs = out_ptr + rows[:, None] * STRIDE_OUT + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _load_tile(ptrs, mask, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask, other=0.0)


_launch = CachedLauncher(_skinny_linear_kernel)
