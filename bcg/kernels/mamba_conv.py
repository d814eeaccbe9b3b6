"""Mamba2's causal depthwise conv (+ SiLU) over x | B | C, with per-sequence conv state.

``causal_conv1d_varlen``: a varlen batch (prefill, chunks, mixed steps). Program (sequence,
channel block, token lane) computes every ``lanes``-th token block of its sequence; a token
less than K - 1 into the sequence reads the inputs before it from the conv state (when the
sequence has a prefix and a slot) or zeros. Lane 0, the only program that reads the old
state, writes the new one (the last K - 1 inputs) after a barrier.

``causal_conv1d_update``: one token per sequence (decode, graph-safe: the grid depends only on
shapes). A sequence's first token (a one-token prompt) reads zeros, not its slot; rows whose
slot is negative (graph padding) read zeros and write nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from bcg.kernels import _pdl
from bcg.kernels._launch import CachedLauncher, DeviceConfigs, next_power_of_2
from bcg.utils import cdiv

MAX_TOKEN_LANES = 16  # token-block programs per sequence and channel block


@dataclass(frozen=True)
class ConvConfig:
    block_c: int
    block_t: int


CONFIGS = DeviceConfigs(gpu=ConvConfig(block_c=128, block_t=32),
                        interpreter=ConvConfig(block_c=32, block_t=8))


def _check(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
           out: torch.Tensor) -> tuple[int, int]:
    channels, taps = weight.shape
    if x.shape[-1] != channels or x.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError(f"x [tokens, {channels}] needs a contiguous last dim and weight "
                         f"[channels, taps] must be contiguous; got x {tuple(x.shape)} strides "
                         f"{x.stride()}")
    if not conv_state.is_contiguous() or conv_state.shape[1:] != (taps - 1, channels):
        raise ValueError(f"conv_state must be contiguous [slots, {taps - 1}, {channels}], got "
                         f"{tuple(conv_state.shape)}")
    if out.shape != x.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(x.shape)} with a contiguous last dim")
    return channels, taps


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_state: torch.Tensor, cu_seqlens: torch.Tensor,
                         seq_lens: torch.Tensor, state_slots: torch.Tensor,
                         out: torch.Tensor) -> None:
    """As `bcg.layers.mamba_ref.causal_conv1d_ref`: x, out `[T, C]`, weight `[C, K]`,
    conv_state `[slots, K - 1, C]`, cu_seqlens `[S + 1]`, seq_lens and state_slots `[S]`."""
    channels, taps = _check(x, weight, conv_state, out)
    config = CONFIGS.for_device(x.is_cuda)
    assert config.block_t >= taps - 1  # only a sequence's first token block reads its state
    num_seqs, tokens = state_slots.shape[0], x.shape[0]
    if num_seqs == 0 or tokens == 0:
        return
    lanes = min(cdiv(tokens, config.block_t), MAX_TOKEN_LANES)
    _launch_varlen(
        (num_seqs, cdiv(channels, config.block_c), lanes),
        (x, weight, weight if bias is None else bias, conv_state, cu_seqlens, seq_lens,
         state_slots, out),
        (),
        {"CHANNELS": channels, "TAPS": taps, "STATE_ROWS": next_power_of_2(max(taps - 1, 1)),
         "HAS_BIAS": bias is not None, "STRIDE_X": x.stride(0), "STRIDE_OUT": out.stride(0),
         "BLOCK_C": config.block_c, "BLOCK_T": config.block_t},
    )


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_state: torch.Tensor, seq_lens: torch.Tensor,
                         state_slots: torch.Tensor, out: torch.Tensor) -> None:
    """As `bcg.layers.mamba_ref.causal_conv1d_update_ref`: x, out `[S, C]`."""
    channels, taps = _check(x, weight, conv_state, out)
    config = CONFIGS.for_device(x.is_cuda)
    if x.shape[0] == 0:
        return
    _launch_update(
        (x.shape[0], cdiv(channels, config.block_c)),
        (x, weight, weight if bias is None else bias, conv_state, seq_lens, state_slots, out),
        (),
        {"CHANNELS": channels, "TAPS": taps, "STATE_ROWS": next_power_of_2(max(taps - 1, 1)),
         "HAS_BIAS": bias is not None, "STRIDE_X": x.stride(0), "STRIDE_OUT": out.stride(0),
         "BLOCK_C": config.block_c, "PDL": _pdl.launches_early(x.device)},
    )


@triton.jit
def _varlen_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, cu_ptr, seq_lens_ptr, slots_ptr, out_ptr,
    CHANNELS: tl.constexpr, TAPS: tl.constexpr, STATE_ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr, STRIDE_X: tl.constexpr, STRIDE_OUT: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
):
    seq = tl.program_id(0)
    lane = tl.program_id(2)
    lanes = tl.num_programs(2)
    start = tl.load(cu_ptr + seq).to(tl.int64)
    length = (tl.load(cu_ptr + seq + 1) - tl.load(cu_ptr + seq)).to(tl.int32)
    slot = tl.load(slots_ptr + seq)
    read_state = (slot >= 0) & (tl.load(seq_lens_ptr + seq) > length)
    state = state_ptr + tl.maximum(slot, 0).to(tl.int64) * ((TAPS - 1) * CHANNELS)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < CHANNELS
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_C], dtype=tl.float32)
    for first in range(lane * BLOCK_T, length, lanes * BLOCK_T):
        rows = first + tl.arange(0, BLOCK_T)
        row_ok = rows < length
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32) + bias[None, :]
        for tap in tl.static_range(TAPS):
            src = rows - (TAPS - 1) + tap  # the input this tap reads, from the sequence start
            in_x = (src >= 0) & row_ok
            in_state = (src < 0) & row_ok & read_state
            value = tl.load(x_ptr + (start + src)[:, None] * STRIDE_X + cols[None, :],
                            mask=in_x[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            value += tl.load(state + (src + TAPS - 1)[:, None] * CHANNELS + cols[None, :],
                             mask=in_state[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            weight = tl.load(w_ptr + cols * TAPS + tap, mask=col_ok, other=0.0).to(tl.float32)
            acc += value * weight[None, :]
        result = acc * tl.sigmoid(acc)
        tl.store(out_ptr + (start + rows)[:, None] * STRIDE_OUT + cols[None, :],
                 result.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    # The new state: the last K - 1 inputs (older ones from the old state if the sequence
    # is shorter), read before the barrier, written after it, by lane 0 alone (another
    # lane reading the old state would race with its write).
    j = tl.arange(0, STATE_ROWS)
    src = length - (TAPS - 1) + j
    keep = (j < TAPS - 1) & (lane == 0)
    new = tl.load(x_ptr + (start + src)[:, None] * STRIDE_X + cols[None, :],
                  mask=((src >= 0) & keep)[:, None] & col_ok[None, :], other=0.0)
    new += tl.load(state + (src + TAPS - 1)[:, None] * CHANNELS + cols[None, :],
                   mask=((src < 0) & keep & read_state)[:, None] & col_ok[None, :], other=0.0)
    tl.debug_barrier()
    write = keep & (slot >= 0)
    tl.store(state + j[:, None] * CHANNELS + cols[None, :], new.to(state_ptr.dtype.element_ty),
             mask=write[:, None] & col_ok[None, :])


@triton.jit
def _update_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, seq_lens_ptr, slots_ptr, out_ptr,
    CHANNELS: tl.constexpr, TAPS: tl.constexpr, STATE_ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr, STRIDE_X: tl.constexpr, STRIDE_OUT: tl.constexpr,
    BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):
    _pdl.start_after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row)
    has_slot = slot >= 0
    read_state = has_slot & (tl.load(seq_lens_ptr + row) > 1)  # not a one-token prompt
    state = state_ptr + tl.maximum(slot, 0).to(tl.int64) * ((TAPS - 1) * CHANNELS)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < CHANNELS
    j = tl.arange(0, STATE_ROWS)
    keep = j < TAPS - 1
    old_ok = (keep & read_state)[:, None] & col_ok[None, :]
    old = tl.load(state + j[:, None] * CHANNELS + cols[None, :], mask=old_ok, other=0.0)
    x = tl.load(x_ptr + row * STRIDE_X + cols, mask=col_ok, other=0.0)
    weights = tl.load(w_ptr + cols[None, :] * TAPS + j[:, None],
                      mask=keep[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    last_weight = tl.load(w_ptr + cols * TAPS + TAPS - 1, mask=col_ok, other=0.0)
    acc = tl.sum(old.to(tl.float32) * weights, 0) + x.to(tl.float32) * last_weight.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    result = acc * tl.sigmoid(acc)
    tl.store(out_ptr + row * STRIDE_OUT + cols, result.to(out_ptr.dtype.element_ty), mask=col_ok)
    # Shift by one: row j takes row j + 1, the last row the new input.
    shifted = tl.load(state + (j + 1)[:, None] * CHANNELS + cols[None, :],
                      mask=((j + 1 < TAPS - 1) & read_state)[:, None] & col_ok[None, :],
                      other=0.0)
    new = tl.where((j == TAPS - 2)[:, None], x[None, :].to(shifted.dtype), shifted)
    tl.debug_barrier()
    tl.store(state + j[:, None] * CHANNELS + cols[None, :], new.to(state_ptr.dtype.element_ty),
             mask=(keep & has_slot)[:, None] & col_ok[None, :])


_launch_varlen = CachedLauncher(_varlen_kernel)
_launch_update = CachedLauncher(_update_kernel)
