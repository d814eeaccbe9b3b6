"""Small launch helpers shared by the kernel modules."""

from __future__ import annotations

import functools
import inspect
import operator
import threading
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from bcg.graph import CaptureNeedsWarmUp
from bcg.kernels import _pdl

# Programs per multiprocessor that keep a memory-bound kernel's loads in flight.
PROGRAMS_PER_SM = 4
# The interpreter has no multiprocessors; pretend to have a few so split paths run in tests.
INTERPRETER_SMS = 2


@functools.cache
def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a small fixed number off CUDA)."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n, for n >= 1 (host-side, cheap)."""
    return 1 << (n - 1).bit_length()


Config = TypeVar("Config")


@dataclass(frozen=True)
class DeviceConfigs(Generic[Config]):
    """A kernel's launch config for CUDA (tuned on an H100: bench/bench_attention.py --tune)
    and one with small tiles for the interpreter, so that CPU tests cover several tiles."""

    gpu: Config
    interpreter: Config

    def for_device(self, on_cuda: bool) -> Config:
        return self.gpu if on_cuda else self.interpreter


def require_last_dim_contiguous(name: str, tensor: torch.Tensor) -> None:
    """Kernels index the last dimension with unit stride; anything else is a caller bug."""
    if tensor.stride(-1) != 1:
        raise last_dim_not_contiguous(name, tensor.stride())


def last_dim_not_contiguous(name: str, strides: tuple[int, ...]) -> ValueError:
    """The error for a tensor whose last dimension has a stride other than 1."""
    return ValueError(
        f"{name} must have a contiguous last dimension (stride 1), got strides "
        f"{strides}; pass {name}.contiguous()"
    )


_triton_hashing: threading.Thread | None = None  # see hash_triton_in_background


def hash_triton_in_background() -> None:
    """Start, in a thread, the hash of Triton's own files that its first kernel lookup in a
    process waits for (libtriton is over 400 MB: about 0.35 s on the H100 host), so it runs
    while weights load; hashlib releases the GIL. Triton caches the result per process, but
    a second caller during the hash would hash again: a kernel's first launch joins it."""
    global _triton_hashing
    import triton.compiler.compiler
    import triton.runtime.cache

    triton_key = getattr(triton.runtime.cache, "triton_key", None) or getattr(
        triton.compiler.compiler, "triton_key", None)  # where older Triton kept it
    if triton_key is not None and _triton_hashing is None:
        _triton_hashing = threading.Thread(target=triton_key, name="triton-key", daemon=True)
        _triton_hashing.start()


def kernel_params(kernel: object) -> list[tuple[str, bool, bool]]:
    """(name, constexpr, do_not_specialize) of each parameter of a Triton kernel, compiled or
    interpreted (on the CPU): the launcher's rules are checked under the interpreter too."""
    if isinstance(kernel, triton.runtime.JITFunction):
        return [(p.name, p.is_constexpr, p.do_not_specialize) for p in kernel.params]
    if not isinstance(kernel, InterpretedFunction):
        return []  # not a plain Triton kernel (autotuned, or a test's stand-in): as it is
    unspecialized = kernel.kwargs.get("do_not_specialize") or ()
    return [(name, "constexpr" in str(param.annotation),
             name in unspecialized or num in unspecialized)
            for num, (name, param) in enumerate(inspect.signature(kernel.fn).parameters.items())]


class CachedLauncher:
    """Launches one Triton kernel through its compiled launcher, skipping ``JITFunction.run``.

    ``JITFunction.run`` re-derives every argument's specialisation and re-reads Triton's
    environment knobs on each call: about 10 µs of host time for a one-argument kernel on the
    H100 host, more than an attention kernel's whole budget. Kernels launched here take
    tensors first, then runtime scalars (every integer among them ``do_not_specialize``),
    then constexprs (strides, sizes, tiles). A compiled kernel is then fully determined by
    the constexprs, the launch options, the device, the tensor dtypes and pointer alignment;
    the fast path serves the usual case of all pointers 16-byte aligned from a cache keyed by
    the rest, and hands the launcher raw addresses (so it skips its per-pointer driver
    query). A kernel whose ``PDL`` constexpr (``bcg.kernels._pdl.CONSTEXPR``) is set launches
    with programmatic dependent launch. A key's first call, misaligned pointers and every
    call under the interpreter go
    through ``JITFunction.run`` (counted in ``slow_launches``); launch hooks (profilers such
    as proton) see only those. A key's first call during a CUDA graph capture, which would
    compile or load a kernel, raises ``CaptureNeedsWarmUp`` instead.
    """

    def __init__(self, kernel: triton.runtime.JITFunction) -> None:
        self.kernel = kernel
        self.compiled: dict[tuple, object] = {}
        self.slow_launches = 0
        self.compiles = isinstance(kernel, triton.runtime.JITFunction)
        params = kernel_params(kernel)
        self.checks_arguments = bool(params)  # a kernel it cannot read launches as it is
        self.constexpr_names = [name for name, constexpr, _ in params if constexpr]
        self.unspecialized = {num for num, (_, _, free) in enumerate(params) if free}
        first_constexpr = len(params) - len(self.constexpr_names)
        if any(constexpr for _, constexpr, _ in params[:first_constexpr]):
            raise TypeError(f"{kernel}: constexpr parameters must come after all others")

    def __call__(
        self,
        grid: tuple[int, ...],
        tensors: tuple[torch.Tensor, ...],
        scalars: tuple,
        constexprs: dict,
        num_warps: int = 4,
        num_stages: int = 3,
    ) -> None:
        """Launch ``kernel[grid](*tensors, *scalars, **constexprs)``; a kernel whose ``PDL``
        constexpr is set waits for the kernel ahead (``bcg.kernels._pdl``), so it launches
        early, with programmatic dependent launch."""
        options = {"num_warps": num_warps, "num_stages": num_stages}
        if constexprs.get(_pdl.CONSTEXPR):
            options["launch_pdl"] = True
        if not self.compiles:
            self._launch_through_triton(grid, tensors, scalars, constexprs, options)
            return
        addresses = [t.data_ptr() for t in tensors]
        misaligned = functools.reduce(operator.or_, addresses) % 16
        device = tensors[0].get_device()
        constants = tuple(constexprs.values())
        key = (device, tuple([t.dtype for t in tensors]), constants, num_warps, num_stages)
        compiled = None if misaligned else self.compiled.get(key)
        if compiled is None:
            if misaligned:  # Triton specialises on which pointers are 16-byte aligned
                key = (*key, tuple([address % 16 == 0 for address in addresses]))
            if key not in self.compiled and torch.cuda.is_current_stream_capturing():
                raise CaptureNeedsWarmUp(
                    f"{self.kernel} meets a new variant during a CUDA graph capture; run the "
                    "captured code once eagerly first"
                )
            self.compiled[key] = self._launch_through_triton(grid, tensors, scalars, constexprs,
                                                             options)
            return
        grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
        compiled.run(
            grid_x, grid_y, grid_z,
            triton.runtime.driver.active.get_current_stream(device),
            compiled.function, compiled.packed_metadata, None, None, None,
            *addresses, *scalars, *constants,
        )

    def _launch_through_triton(self, grid, tensors, scalars, constexprs, options) -> object:
        """The ordinary launch (compiling if needed); returns Triton's compiled kernel."""
        self.slow_launches += 1
        if _triton_hashing is not None:
            _triton_hashing.join()
        if self.constexpr_names and list(constexprs) != self.constexpr_names:
            raise TypeError(
                f"{self.kernel}: pass constexprs in signature order {self.constexpr_names}"
            )
        args = (*tensors, *scalars)
        for index, arg in enumerate(args):
            is_int = isinstance(arg, int) and not isinstance(arg, bool)
            if self.checks_arguments and is_int and index not in self.unspecialized:
                raise TypeError(
                    f"{self.kernel}: integer argument {index} must be a constexpr or listed in "
                    "do_not_specialize to be launched through CachedLauncher"
                )
        return self.kernel[grid](*args, **constexprs, **options)
