"""Segment launches straight through the CUDA driver's `cuGraphLaunch`.

torch's `CUDAGraph.replay()` spends about 4.3 µs of host time per call (pybind11, a device
guard, the random generators' replay prologue, the runtime's wrapper); the driver's call,
bound once per stream with ctypes, about 2.2 µs (an H200; `bench_graph` has the H100's
figures). A breakable replay launches a segment per break, so this is most of what a break
costs beyond its own body.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch


def _check_result(code: int, function: Any, arguments: tuple) -> None:
    """ctypes' `errcheck`: raise on a driver call's error code."""
    if code:
        name = ctypes.c_char_p()
        _driver.cuGetErrorName(code, ctypes.byref(name))
        raise RuntimeError(f"{function.__name__} failed with CUDA error {code} "
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
    driver.cuGraphLaunch.restype = ctypes.c_int
    driver.cuGraphLaunch.errcheck = _check_result
    driver.cuCtxGetCurrent.argtypes = (ctypes.POINTER(ctypes.c_void_p),)
    driver.cuCtxGetCurrent.restype = ctypes.c_int
    driver.cuCtxGetCurrent.errcheck = _check_result
    return driver


_driver = _load_driver()
_thread = threading.local()


def plain_cuda_graph(segment: Any) -> bool:
    """True if `segment` is a torch CUDA graph whose `replay()` has no Python work to do
    (no input-liveness tracker, which bcg never asks for)."""
    return (isinstance(segment, torch.cuda.CUDAGraph)
            and getattr(segment, "_tracker", None) is None)


def launches_through_driver(segment: Any) -> bool:
    """True if the driver can launch `segment` in place of torch's `replay()` (whose
    random-generator prologue the replay keeps where a segment needs it)."""
    return (_driver is not None and plain_cuda_graph(segment)
            and hasattr(segment, "raw_cuda_graph_exec"))


def driver_launcher(segment: torch.cuda.CUDAGraph, stream: int) -> Callable[[], None]:
    """A call that launches `segment` on the raw CUDA stream `stream`."""
    return functools.partial(_driver.cuGraphLaunch, segment.raw_cuda_graph_exec(), stream)


def thread_has_context() -> bool:
    """Whether this thread has a current CUDA context, which a launch on the legacy default
    stream needs; the runtime (torch's launches) makes one current, the driver does not.
    Asked once per thread until the answer is yes."""
    if getattr(_thread, "has_context", False):
        return True
    context = ctypes.c_void_p()
    _driver.cuCtxGetCurrent(ctypes.byref(context))
    _thread.has_context = context.value is not None
    return _thread.has_context


def current_raw_stream(device: int) -> int:
    """The handle of `device`'s current stream, without making a `torch.cuda.Stream`."""
    return torch._C._cuda_getCurrentRawStream(device)


def generator_offset(device: int) -> int:
    """The default CUDA generator's offset: a segment's replay advances it exactly when
    the segment draws random numbers from it (torch's replay prologue, which a driver
    launch skips). It is the only generator a segment can draw from: torch refuses, at
    capture, one not registered with the capturing graph, and bcg registers none."""
    return torch.cuda.default_generators[device].get_offset()
