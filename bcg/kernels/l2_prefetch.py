"""Pull the head of a weight into the L2 cache from inside a kernel that mostly waits.

A decode step streams each projection's weight from memory, and between two projections
run small kernels that leave the memory idle: the residual add and the RMSNorm, rotary and
decode attention, and under tensor parallelism an all-reduce that waits for its peers.
Such a kernel can ask the L2 cache for the first bytes of the weight the next projection
reads (`cp.async.bulk.prefetch.L2`: fire and forget, the kernel does not wait for the data),
so that projection finds them there. On an H100, a projection after an 8 µs wait took 2-3
µs less with 16 MiB of its weight asked for (bench/results/ab_prefetch/micro.log).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bcg.utils import cdiv

ALIGNMENT = 128  # bytes: a cache line; pieces and the total are multiples of it


def prefetch_args(prefetch: torch.Tensor | None, programs: int, num_warps: int) -> dict:
    """The constexprs of `prefetch_l2` for a launch of `programs` programs of `num_warps`
    warps sharing the bytes of `prefetch` (a flat uint8 CUDA tensor; None: none)."""
    total = 0 if prefetch is None or not prefetch.is_cuda else prefetch.numel()
    threads = 32 * num_warps
    share = cdiv(cdiv(total, max(1, programs)), ALIGNMENT) * ALIGNMENT
    return {"PREFETCH_BYTES": total, "PREFETCH_SHARE": share, "PREFETCH_THREADS": threads,
            "PREFETCH_ROUNDS": cdiv(share, threads * ALIGNMENT)}


def weight_head(weight: torch.Tensor, max_bytes: int) -> torch.Tensor | None:
    """The first `max_bytes` of `weight` (whole cache lines) as a flat uint8 view, or None
    off CUDA, for nothing to fetch or a weight not aligned to a cache line."""
    if max_bytes <= 0 or not weight.is_cuda or not weight.is_contiguous():
        return None
    flat = weight.detach().reshape(-1).view(torch.uint8)
    size = min(max_bytes, flat.numel()) // ALIGNMENT * ALIGNMENT
    return flat[:size] if size and flat.data_ptr() % ALIGNMENT == 0 else None


@triton.jit
def prefetch_l2(base_ptr, TOTAL: tl.constexpr, SHARE: tl.constexpr, THREADS: tl.constexpr,
                ROUNDS: tl.constexpr):
    """Ask L2 for this program's `SHARE` of the `TOTAL` bytes at `base_ptr` (nothing if
    `TOTAL` is 0), a cache line a thread per round."""
    if TOTAL > 0:
        first = tl.program_id(0) * SHARE
        end = tl.minimum(first + SHARE, TOTAL)
        for round in range(ROUNDS):
            offsets = first + (round * THREADS + tl.arange(0, THREADS)) * 128
            inside = offsets < end
            offsets = tl.where(inside, offsets, 0)
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; }"
                " mov.u32 $0, 0;",
                "=r,l,r", [base_ptr + offsets, inside.to(tl.int32)], dtype=tl.int32,
                is_pure=False, pack=1)
