"""Segment launches straight through the CUDA driver's `cuGraphLaunch`.

torch's `CUDAGraph.replay()` spends about 4.3 µs of host time per call (pybind11, a device
guard, a loop over the random generators, the runtime's wrapper); the driver's call, bound
once per stream with ctypes, about 2.2 µs (H200, `bench_graph`). A breakable replay
launches a segment per break, so this is most of what a break costs beyond its own body.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable
from typing import Any

import torch


def _raise_on_error(code: int) -> None:
    """ctypes calls this with `cuGraphLaunch`'s result code."""
    if code:
        name = ctypes.c_char_p()
        _driver.cuGetErrorName(code, ctypes.byref(name))
        raise RuntimeError(f"cuGraphLaunch failed with CUDA error {code} "
                           f"({(name.value or b'unknown').decode()})")


def _load_driver() -> ctypes.CDLL | None:
    """The CUDA driver library, where this process can call it (not under ROCm)."""
    if sys.platform != "linux" or torch.version.hip is not None:
        return None
    try:
        driver = ctypes.CDLL("libcuda.so.1")  # CDLL: the GIL is released during the call
    except OSError:
        return None
    driver.cuGraphLaunch.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
    driver.cuGraphLaunch.restype = _raise_on_error
    return driver


_driver = _load_driver()


def launches_through_driver(segment: Any) -> bool:
    """True if `segment` is a torch CUDA graph the driver can launch in its place: its
    replay would do nothing but launch (no input-liveness tracker, which bcg never asks
    for) and this process can reach the driver."""
    return (_driver is not None and isinstance(segment, torch.cuda.CUDAGraph)
            and getattr(segment, "_tracker", None) is None
            and hasattr(segment, "raw_cuda_graph_exec"))


def driver_launcher(segment: torch.cuda.CUDAGraph, stream: int) -> Callable[[], None]:
    """A call that launches `segment` on the raw CUDA stream `stream`."""
    return functools.partial(_driver.cuGraphLaunch, segment.raw_cuda_graph_exec(), stream)


def current_raw_stream(device: int) -> int:
    """The handle of `device`'s current stream, without making a `torch.cuda.Stream`."""
    return torch._C._cuda_getCurrentRawStream(device)


def generator_offset(device: int) -> int:
    """The default CUDA generator's offset: a segment's replay advances it exactly when
    the segment draws random numbers (torch's replay prologue, which a driver launch
    skips)."""
    return torch.cuda.default_generators[device].get_offset()
