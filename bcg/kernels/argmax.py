"""Greedy sampling's argmax over the vocabulary for a few rows, in one launch.

PyTorch reduces a row of qwen3's 152k logits in one block of threads: 9.3 µs of the H100's
batch-1 decode step (bench/results/s41). Here each row is cut into splits of whole blocks,
one program a split, and the last split of a row to finish (an arrival count, as decode
attention's splits merge) picks among the splits' maxima. Ties go to the lowest index and a
NaN wins over every number, as `torch.argmax` documents.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bcg.kernels._launch import CachedLauncher, DeviceConfigs, next_power_of_2
from bcg.utils import cdiv

MAX_ROWS = 16  # past a decode-sized step PyTorch's block a row fills the GPU itself
MAX_SPLITS = 64
# Logits a program loads at a time: four iterations a split on the CUDA path; a few
# splits on a small vocabulary under the interpreter, so the CPU tests merge splits.
BLOCKS = DeviceConfigs(gpu=1024, interpreter=16)


class ArgmaxWorkspace:
    """Each device's partial maxima and arrival counts (the counts reset by the kernel), kept
    across calls: allocating and zeroing them per call would cost a launch more."""

    def __init__(self) -> None:
        self._by_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def for_rows(self, rows: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        buffers = self._by_device.get(device)
        if buffers is None or buffers[2].numel() < rows:
            buffers = (torch.empty(rows * MAX_SPLITS, dtype=torch.float32, device=device),
                       torch.empty(rows * MAX_SPLITS, dtype=torch.int64, device=device),
                       torch.zeros(rows, dtype=torch.int32, device=device))
            self._by_device[device] = buffers
        return buffers


_WORKSPACE = ArgmaxWorkspace()


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` of `[rows, vocab]` logits (last dimension contiguous), int64
    `[rows]`. Launches on the logits' stream; not for two streams at once on one device."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"expected [rows, vocab] logits with contiguous rows, got shape "
                         f"{tuple(logits.shape)} and strides {logits.stride()}")
    rows, vocab = logits.shape
    block = BLOCKS.for_device(logits.is_cuda)
    per_split = cdiv(cdiv(vocab, MAX_SPLITS), block) * block
    splits = cdiv(vocab, per_split)
    values, indices, arrivals = _WORKSPACE.for_rows(rows, logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _launch((rows, splits), (logits, out, values, indices, arrivals),
            (vocab, logits.stride(0), per_split),
            {"SPLITS_P2": next_power_of_2(splits), "BLOCK": block}, num_warps=4)
    return out


@triton.jit(do_not_specialize=["vocab", "row_stride", "per_split"])
def _argmax_kernel(logits_ptr, out_ptr, values_ptr, indices_ptr, arrivals_ptr, vocab,
                   row_stride, per_split, SPLITS_P2: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    start = split * per_split
    end = tl.minimum(start + per_split, vocab)
    never = vocab  # past every index: "none found"
    best = tl.full([], float("-inf"), tl.float32)
    best_index = start
    first_nan = never
    for offset in range(start, end, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        inside = cols < end
        x = tl.load(logits_ptr + row.to(tl.int64) * row_stride + cols, mask=inside,
                    other=float("-inf")).to(tl.float32)
        is_nan = x != x
        first_nan = tl.minimum(first_nan, tl.min(tl.where(is_nan & inside, cols, never), 0))
        x = tl.where(is_nan, float("-inf"), x)
        top = tl.max(x, 0)
        top_index = tl.min(tl.where((x == top) & inside, cols, never), 0)
        better = top > best  # an equal maximum later in the row loses
        best_index = tl.where(better, top_index, best_index)
        best = tl.maximum(best, top)
    has_nan = first_nan < never
    slot = row * SPLITS_P2 + split
    tl.store(values_ptr + slot, tl.where(has_nan, float("nan"), best))
    tl.store(indices_ptr + slot, tl.where(has_nan, first_nan, best_index).to(tl.int64))
    # The last split in (its acquire sees every split's release) merges the row. The
    # barriers: one thread does the atomic; its release and acquire must cover every thread.
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel")
    if arrived == splits - 1:
        tl.debug_barrier()
        parts = tl.arange(0, SPLITS_P2)
        used = parts < splits
        values = tl.load(values_ptr + row * SPLITS_P2 + parts, mask=used,
                         other=float("-inf"), cache_modifier=".cg")
        indices = tl.load(indices_ptr + row * SPLITS_P2 + parts, mask=used, other=0,
                          cache_modifier=".cg")
        nan_parts = (values != values) & used
        top = tl.max(tl.where(nan_parts, float("-inf"), values), 0)
        winners = tl.where(tl.max(nan_parts.to(tl.int32), 0) > 0, nan_parts,
                           (values == top) & used)
        first = tl.min(tl.where(winners, parts, SPLITS_P2), 0)
        tl.store(out_ptr + row, tl.sum(tl.where(parts == first, indices, 0), 0))
        tl.store(arrivals_ptr + row, 0)  # ready for the next call


_launch = CachedLauncher(_argmax_kernel)
