"""Programmatic dependent launch (PDL) for the kernels of a decode step.

A decode step at small batch is a chain of short dependent kernels, each paying its launch
and ramp after the one before has drained. A kernel launched with PDL may start while the
kernel ahead of it still runs, once every program of that one has called
`gdc_launch_dependents` or exited; it then waits (`gdc_wait`, which returns when the kernel
ahead has completed and its writes are visible) before it touches memory, so the results are
the same, and only its launch overlaps the other's tail.

Every kernel launched early waits first, before any memory access: the completion of each
then implies its predecessor's along the whole chain, which the custom all-reduce's slot
reuse relies on (`bcg.kernels.all_reduce_norm`). The short kernels (the norms, the Mamba2
gated norm too, the rotary kernel, the Mamba2 conv and state updates, the MoE routing,
alignment and top-k sum) and the custom all-reduce (with its add and norm) then let the next
kernel start at once; the all-reduce's dependents sit resident while it waits for its peers,
harmless as all its programs are already running. The skinny projections (a
tensor-parallel one's send to its peers too) and the MoE grouped GEMMs let the next start
only after their weight loop. Decode attention lets the next start only as its programs
exit: launched beside attention's hundreds of programs, the o projection's took 1.5x as
long (qwen3-8b at batch 1 on an H200: 16.9 against 11.0 µs at tp1, 7.7 against 6.9 at tp2;
session 43), most likely placed two to a multiprocessor by the block scheduler, which places
a kernel's programs as it launches them. Session 26 had every kernel let the next start
before its own wait, which cost qwen3-8b 3-4% a step on an H100 (cause not found); this
order gains on both models measured (README, `bench_decode`). Letting the next start only
after the wait also keeps at most two kernels of the chain resident at a time.

On by default on GPUs that have it (compute capability 9.0 and up, Triton with
`tl.extra.cuda.gdc_wait`); `BCG_PDL=0` in the environment turns it off, to compare.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from bcg.utils import switch_from_environment

# The constexpr a kernel takes to launch early: `CachedLauncher` adds the launch option
# whenever it is set, so the wait and the early launch always come together.
CONSTEXPR = "PDL"
SWITCHED_ON = switch_from_environment("BCG_PDL")
TRITON_HAS_PDL = getattr(getattr(tl.extra, "cuda", None), "gdc_wait", None) is not None
MIN_CAPABILITY = (9, 0)


@functools.cache
def _device_has_pdl(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def launches_early(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (and so must wait in their first
    statement, `start_after_previous`)."""
    return SWITCHED_ON and TRITON_HAS_PDL and device.type == "cuda" and _device_has_pdl(device)


@triton.jit
def start_after_previous(ON: tl.constexpr):
    """A short kernel's first statement: wait for the kernel ahead, then let the next one
    start."""
    if ON:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_previous(ON: tl.constexpr):
    """Wait until the kernel ahead has finished and its writes are visible."""
    if ON:
        tl.extra.cuda.gdc_wait()


@triton.jit
def launch_dependents(ON: tl.constexpr):
    """Let the next kernel, if launched with PDL, start now."""
    if ON:
        tl.extra.cuda.gdc_launch_dependents()
