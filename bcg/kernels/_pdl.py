"""Programmatic dependent launch for the decode chain (an experiment: knobs from the
environment until it is measured). A kernel launched with it may start while the kernel
ahead of it still runs, once every program of that kernel has called
`gdc_launch_dependents`: a projection then asks the L2 cache for its weight, which reads
nothing the kernel ahead writes, and waits (`gdc_wait`) only before it reads its input. The
norms and decode attention ahead of the projections let them start at once.

BCG_PDL=1 turns it on (CUDA only); BCG_PREFETCH_MB caps the bytes of weight a projection
asks for (default 16); BCG_SKINNY_ALL=1 takes every decode-sized projection through the
skinny kernel, also those too narrow to fill the device.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

ENABLED = os.environ.get("BCG_PDL", "0") == "1"
PREFETCH_BYTES = int(float(os.environ.get("BCG_PREFETCH_MB", "16")) * 2**20)
SKINNY_ALL = os.environ.get("BCG_SKINNY_ALL", "0") == "1"
LINE = 128  # bytes an L2 prefetch asks for
LINES_PER_STEP = tl.constexpr(16)


@triton.jit
def launch_dependents(ON: tl.constexpr):
    """Let the next kernel (if launched with PDL) start now."""
    if ON:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_previous(ON: tl.constexpr):
    """Wait until the kernel ahead has finished and its writes are visible."""
    if ON:
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_rows(ptr, rows, row_mask, STRIDE: tl.constexpr, ELEMENTS: tl.constexpr,
                  ELEMENTS_PER_LINE: tl.constexpr):
    """Ask L2 for the first `ELEMENTS` of each of `rows` (a multiple of 16 lines), fire
    and forget; masked rows ask for the first row's head again."""
    for start in tl.static_range(0, ELEMENTS, LINES_PER_STEP * ELEMENTS_PER_LINE):
        offsets = start + tl.arange(0, LINES_PER_STEP) * ELEMENTS_PER_LINE
        ptrs = ptr + tl.where(row_mask, rows, 0)[:, None] * STRIDE + offsets[None, :]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)


def prefetch_elements(rows: int, k: int, element_size: int) -> int:
    """Elements of each weight row to ask for: the cap's share, whole steps of 16 lines."""
    step = LINES_PER_STEP.value * LINE // element_size
    share = PREFETCH_BYTES // max(1, rows * element_size)
    return min(k, share) // step * step
