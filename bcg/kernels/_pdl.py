"""Programmatic dependent launch for the decode chain (an experiment: a knob from the
environment until it is measured). A kernel launched with it may start while the kernel
ahead of it still runs, once every program of that kernel has called
`gdc_launch_dependents`, and waits (`gdc_wait`) for it before touching memory: its launch
overlaps the kernel ahead's tail.

BCG_PDL=1 launches the skinny projections so (CUDA only), the norms and decode attention
ahead of them letting them start at once; BCG_PDL=2 also launches the norms, the rotary
kernel and decode attention so.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

MODE = int(os.environ.get("BCG_PDL", "0"))


def role(on_cuda: bool, launched_early: bool = True) -> int:
    """A kernel's part: 0 none, 1 lets the next kernel start (launched as usual), 2 also
    launched early itself."""
    if not on_cuda or MODE == 0:
        return 0
    return 2 if MODE == 2 and launched_early else 1


@triton.jit
def begin(ROLE: tl.constexpr):
    """First statement of a kernel taking part: wait for the kernel ahead if launched early,
    then let the next one start."""
    if ROLE == 2:
        tl.extra.cuda.gdc_wait()
    if ROLE >= 1:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_previous(ON: tl.constexpr):
    """Wait until the kernel ahead has finished and its writes are visible."""
    if ON:
        tl.extra.cuda.gdc_wait()


@triton.jit
def launch_dependents(ON: tl.constexpr):
    """Let the next kernel (if launched early) start now."""
    if ON:
        tl.extra.cuda.gdc_launch_dependents()
