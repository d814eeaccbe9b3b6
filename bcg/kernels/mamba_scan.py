"""Mamba2's SSM over per-sequence state: the chunked scan (prefill) and the one-token
selective state update (decode).

``ssd_scan_varlen``: program (sequence, head, head-dim block) walks its sequence chunk by
chunk, holding the state tile `[block_p, N]` in registers (fp32) from the cached initial
state to the final one, which it writes back. Within a chunk of Q tokens the state-space
dual form runs on tensor cores: y = ((C Bᵀ) ∘ decay ∘ dt) x + exp(cumsum) · C stateᵀ + D x,
then state = exp(total) · state + (x ∘ dt ∘ decay-to-end)ᵀ B. No program waits on another
(each owns its tile of the state), so several sequences, chunks of any length and decode
rows mix freely; the kernel's chunk length need not be the model's (the math is exact).

``selective_state_update``: one token per sequence (graph-safe); a sequence's first token (a
one-token prompt) starts from zeros, not its slot; rows with a negative slot (graph padding)
start from zeros and write nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from bcg.kernels import _pdl
from bcg.kernels._launch import CachedLauncher, DeviceConfigs, next_power_of_2
from bcg.utils import cdiv


@dataclass(frozen=True)
class ScanConfig:
    chunk: int  # tokens per step of the scan (>= 16: tl.dot's smallest)
    max_block_p: int
    num_warps: int


# 8 warps on the GPU: the state, B and C tiles of a 64-token chunk are 64 fp32 registers
# per thread each at 4 warps. Chunks of up to SMALL_CHUNK tokens (short sequences) take 4.
SMALL_CHUNK = 32
CONFIGS = DeviceConfigs(gpu=ScanConfig(chunk=64, max_block_p=64, num_warps=8),
                        interpreter=ScanConfig(chunk=16, max_block_p=16, num_warps=1))


def _shapes(x: torch.Tensor, B: torch.Tensor, ssm_state: torch.Tensor,
            out: torch.Tensor) -> tuple[int, int, int, int]:
    """(heads, head_dim, groups, state size), after checking the layouts the kernels index."""
    _, heads, head_dim = x.shape
    groups, state_size = B.shape[1], B.shape[2]
    if x.stride(2) != 1 or x.stride(1) != head_dim or out.stride(2) != 1 \
            or out.stride(1) != head_dim or out.shape != x.shape:
        raise ValueError("x and out must be [tokens, heads, head_dim] with contiguous heads")
    if B.stride(2) != 1 or B.stride(1) != state_size:
        raise ValueError("B and C must be [tokens, groups, state] with contiguous groups")
    if not ssm_state.is_contiguous() or ssm_state.dtype != torch.float32 \
            or ssm_state.shape[1:] != (heads, head_dim, state_size):
        raise ValueError(f"ssm_state must be contiguous fp32 [slots, {heads}, {head_dim}, "
                         f"{state_size}], got {ssm_state.dtype} {tuple(ssm_state.shape)}")
    if heads % groups:
        raise ValueError(f"{heads} heads cannot share {groups} groups evenly")
    return heads, head_dim, groups, state_size


def ssd_scan_varlen(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                    C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                    dt_limit: tuple[float, float], chunk_size: int, ssm_state: torch.Tensor,
                    cu_seqlens: torch.Tensor, seq_lens: torch.Tensor, state_slots: torch.Tensor,
                    out: torch.Tensor) -> None:
    """As `bcg.layers.mamba_ref.ssd_scan_ref`. The kernel steps by its own chunk length (the
    math is exact for any), at most `chunk_size` rounded up: a batch of short sequences
    passes its longest, so a chunk is not mostly padding."""
    heads, head_dim, groups, state_size = _shapes(x, B, ssm_state, out)
    if C.stride() != B.stride():
        raise ValueError("B and C must share one layout")
    config = CONFIGS.for_device(x.is_cuda)
    num_seqs = state_slots.shape[0]
    if num_seqs == 0 or x.shape[0] == 0:
        return
    block_p = min(max(16, next_power_of_2(head_dim)), config.max_block_p)
    chunk = min(config.chunk, max(16, next_power_of_2(chunk_size)))
    _launch_scan(
        (num_seqs, heads, cdiv(head_dim, block_p)),
        (x, dt, A, B, C, D, dt_bias, ssm_state, cu_seqlens, seq_lens, state_slots, out),
        _dt_bounds(dt_limit),
        {"HEADS": heads, "HEAD_DIM": head_dim, "HEADS_PER_GROUP": heads // groups,
         "STATE": state_size, "STRIDE_X": x.stride(0), "STRIDE_DT": dt.stride(0),
         "STRIDE_B": B.stride(0), "STRIDE_OUT": out.stride(0), "CHUNK": chunk,
         "BLOCK_P": block_p, "BLOCK_N": max(16, next_power_of_2(state_size)),
         "DOT_PRECISION": _dot_precision(x.dtype)},
        num_warps=config.num_warps if chunk > SMALL_CHUNK else min(4, config.num_warps),
    )


def selective_state_update(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
                           dt_bias: torch.Tensor, dt_limit: tuple[float, float],
                           ssm_state: torch.Tensor, seq_lens: torch.Tensor,
                           state_slots: torch.Tensor, out: torch.Tensor) -> None:
    """As `bcg.layers.mamba_ref.selective_state_update_ref`: x, out `[S, H, P]`."""
    heads, head_dim, groups, state_size = _shapes(x, B, ssm_state, out)
    if C.stride() != B.stride():
        raise ValueError("B and C must share one layout")
    config = CONFIGS.for_device(x.is_cuda)
    if x.shape[0] == 0:
        return
    block_p = min(next_power_of_2(head_dim), config.max_block_p)
    _launch_update(
        (x.shape[0], heads, cdiv(head_dim, block_p)),
        (x, dt, A, B, C, D, dt_bias, ssm_state, seq_lens, state_slots, out),
        _dt_bounds(dt_limit),
        {"HEADS": heads, "HEAD_DIM": head_dim, "HEADS_PER_GROUP": heads // groups,
         "STATE": state_size, "STRIDE_X": x.stride(0), "STRIDE_DT": dt.stride(0),
         "STRIDE_B": B.stride(0), "STRIDE_OUT": out.stride(0), "BLOCK_P": block_p,
         "BLOCK_N": next_power_of_2(state_size), "PDL": _pdl.launches_early(x.device)},
    )


def _dot_precision(dtype: torch.dtype) -> str:
    """The scan's dots take fp32 operands (converted on load): exact ones for an fp32
    model, TF32 (tensor cores, a 10-bit mantissa, finer than bf16's) for half types."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _dt_bounds(dt_limit: tuple[float, float]) -> tuple[float, float]:
    """The kernels' runtime scalars (dt_low, dt_high); inf passes as fp32 inf."""
    low, high = dt_limit
    return float(low), float(high)


@triton.jit
def _step_size(raw, bias, dt_low, dt_high):
    """softplus(raw + bias) (as torch: linear above 20, log1p made exact), clamped into
    [dt_low, dt_high]."""
    v = raw.to(tl.float32) + bias
    e = tl.exp(tl.minimum(v, 20.0))
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * e / (u - 1.0))
    return tl.minimum(tl.maximum(tl.where(v > 20.0, v, log1p), dt_low), dt_high)


@triton.jit
def _scan_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dt_bias_ptr, state_ptr, cu_ptr, seq_lens_ptr,
    slots_ptr, out_ptr, dt_low, dt_high,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PER_GROUP: tl.constexpr,
    STATE: tl.constexpr, STRIDE_X: tl.constexpr, STRIDE_DT: tl.constexpr,
    STRIDE_B: tl.constexpr, STRIDE_OUT: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    group = head // HEADS_PER_GROUP
    start = tl.load(cu_ptr + seq).to(tl.int64)
    length = (tl.load(cu_ptr + seq + 1) - tl.load(cu_ptr + seq)).to(tl.int32)
    slot = tl.load(slots_ptr + seq)
    read_state = (slot >= 0) & (tl.load(seq_lens_ptr + seq) > length)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    tile_ok = (p < HEAD_DIM)[:, None] & (n < STATE)[None, :]
    state_tile = (state_ptr + (tl.maximum(slot, 0).to(tl.int64) * HEADS + head) * HEAD_DIM * STATE
                  + p[:, None] * STATE + n[None, :])
    state = tl.load(state_tile, mask=tile_ok & read_state, other=0.0)
    a_head = tl.load(a_ptr + head).to(tl.float32)
    d_head = tl.load(d_ptr + head).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    t = tl.arange(0, CHUNK)
    causal = t[:, None] >= t[None, :]
    for first in range(0, length, CHUNK):
        rows = first + t
        row_ok = rows < length
        tokens = start + rows
        dt = _step_size(tl.load(dt_ptr + tokens * STRIDE_DT + head, mask=row_ok, other=0.0),
                        dt_bias, dt_low, dt_high)
        dt = tl.where(row_ok, dt, 0.0)  # padding rows neither decay nor add
        decay = tl.cumsum(dt * a_head, 0)  # log of the decay from the chunk's start
        x = tl.load(x_ptr + tokens[:, None] * STRIDE_X + head * HEAD_DIM + p[None, :],
                    mask=row_ok[:, None] & (p < HEAD_DIM)[None, :], other=0.0).to(tl.float32)
        bc_offsets = tokens[:, None] * STRIDE_B + group * STATE + n[None, :]
        bc_ok = row_ok[:, None] & (n < STATE)[None, :]
        b = tl.load(b_ptr + bc_offsets, mask=bc_ok, other=0.0).to(tl.float32)
        c = tl.load(c_ptr + bc_offsets, mask=bc_ok, other=0.0).to(tl.float32)
        gap = tl.where(causal, decay[:, None] - decay[None, :], float("-inf"))
        scores = tl.dot(c, tl.trans(b), input_precision=DOT_PRECISION) * tl.exp(gap) \
            * dt[None, :]
        y = tl.dot(scores, x, input_precision=DOT_PRECISION)
        y += tl.dot(c, tl.trans(state), input_precision=DOT_PRECISION) * tl.exp(decay)[:, None]
        y += d_head * x
        tl.store(out_ptr + tokens[:, None] * STRIDE_OUT + head * HEAD_DIM + p[None, :],
                 y.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (p < HEAD_DIM)[None, :])
        total = tl.sum(tl.where(t == CHUNK - 1, decay, 0.0), 0)  # padding adds nothing
        to_end = tl.exp(total - decay) * dt
        state = state * tl.exp(total) + tl.dot(tl.trans(x * to_end[:, None]), b,
                                               input_precision=DOT_PRECISION)
    tl.store(state_tile, state, mask=tile_ok & (slot >= 0))


@triton.jit
def _update_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dt_bias_ptr, state_ptr, seq_lens_ptr, slots_ptr,
    out_ptr, dt_low, dt_high,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PER_GROUP: tl.constexpr,
    STATE: tl.constexpr, STRIDE_X: tl.constexpr, STRIDE_DT: tl.constexpr,
    STRIDE_B: tl.constexpr, STRIDE_OUT: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    _pdl.start_after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    group = head // HEADS_PER_GROUP
    slot = tl.load(slots_ptr + row)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok, n_ok = p < HEAD_DIM, n < STATE
    tile_ok = p_ok[:, None] & n_ok[None, :]
    state_tile = (state_ptr + (tl.maximum(slot, 0).to(tl.int64) * HEADS + head) * HEAD_DIM * STATE
                  + p[:, None] * STATE + n[None, :])
    read_state = (slot >= 0) & (tl.load(seq_lens_ptr + row) > 1)  # not a one-token prompt
    state = tl.load(state_tile, mask=tile_ok & read_state, other=0.0)
    dt = _step_size(tl.load(dt_ptr + row * STRIDE_DT + head),
                    tl.load(dt_bias_ptr + head).to(tl.float32), dt_low, dt_high)
    x = tl.load(x_ptr + row * STRIDE_X + head * HEAD_DIM + p, mask=p_ok, other=0.0)
    x = x.to(tl.float32)
    b = tl.load(b_ptr + row * STRIDE_B + group * STATE + n, mask=n_ok, other=0.0)
    c = tl.load(c_ptr + row * STRIDE_B + group * STATE + n, mask=n_ok, other=0.0)
    state = state * tl.exp(dt * tl.load(a_ptr + head).to(tl.float32))
    state += (dt * x)[:, None] * b.to(tl.float32)[None, :]
    y = tl.sum(state * c.to(tl.float32)[None, :], 1) + tl.load(d_ptr + head).to(tl.float32) * x
    tl.store(out_ptr + row * STRIDE_OUT + head * HEAD_DIM + p, y.to(out_ptr.dtype.element_ty),
             mask=p_ok)
    tl.store(state_tile, state, mask=tile_ok & (slot >= 0))


_launch_scan = CachedLauncher(_scan_kernel)
_launch_update = CachedLauncher(_update_kernel)
