"""Small launch helpers shared by the kernel modules."""

from __future__ import annotations

import functools

import torch
import triton

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


def require_last_dim_contiguous(name: str, tensor: torch.Tensor) -> None:
    """Kernels index the last dimension with unit stride; anything else is a caller bug."""
    if tensor.stride(-1) != 1:
        raise ValueError(
            f"{name} must have a contiguous last dimension (stride 1), got strides "
            f"{tuple(tensor.stride())}; pass {name}.contiguous()"
        )


def require_same_device(**tensors: torch.Tensor) -> None:
    """All tensors of one kernel call must live on one device."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def paged_cache_geometry(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[int, int, int]:
    """Validate a paged KV cache against ``q``; returns (block_size, num_kv_heads, group).

    ``q`` is ``[num_tokens, num_heads, head_dim]``; each cache is
    ``[num_blocks, block_size, num_kv_heads, head_dim]``, both with the same strides.
    """
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(
            f"expected q [tokens, heads, head_dim] and caches [blocks, block_size, kv_heads, "
            f"head_dim], got q {tuple(q.shape)} and k_cache {tuple(k_cache.shape)}"
        )
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    if q.shape[2] != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}: head_dim must "
            "match and num_heads must be a multiple of num_kv_heads"
        )
    for size, what in ((head_dim, "head_dim"), (block_size, "block_size")):
        if size & (size - 1):
            raise ValueError(f"{what} must be a power of two, got {size}")
    require_last_dim_contiguous("q", q)
    require_last_dim_contiguous("k_cache", k_cache)
    return block_size, num_kv_heads, num_heads // num_kv_heads


class CachedLauncher:
    """Launches one Triton kernel through its compiled launcher, skipping ``JITFunction.run``.

    ``JITFunction.run`` re-derives every argument's specialisation and re-reads Triton's
    environment knobs on each call: about 12 µs of host time for a one-argument kernel on the
    H100 host, 40+ µs for an attention kernel, more than the whole call may take on the GPU.
    Kernels launched here take their strides and sizes as constexprs and declare every other
    integer ``do_not_specialize``, so a compiled kernel is fully determined by the
    constexprs, the launch options, the device and each tensor's dtype and 16-byte
    alignment: that tuple keys a cache of compiled kernels. A key's first call, and every
    call under the interpreter, goes through ``JITFunction.run``. Launch hooks (profilers
    such as proton) see only those first calls.
    """

    def __init__(self, kernel: triton.runtime.JITFunction) -> None:
        self.kernel = kernel
        self.compiled: dict[tuple, object] = {}
        self.compiles = isinstance(kernel, triton.runtime.JITFunction)
        params = kernel.params if self.compiles else []
        self.constexpr_names = [p.name for p in params if p.is_constexpr]
        self.unspecialized = {p.num for p in params if p.do_not_specialize}
        first_constexpr = len(params) - len(self.constexpr_names)
        if any(p.is_constexpr for p in params[:first_constexpr]):
            raise TypeError(f"{kernel}: constexpr parameters must come after all others")

    def __call__(
        self,
        grid: tuple[int, ...],
        args: tuple,
        constexprs: dict,
        num_warps: int = 4,
        num_stages: int = 3,
    ) -> None:
        """Launch ``kernel[grid](*args, **constexprs)``; ``args`` are the runtime arguments."""
        if not self.compiles:
            self.kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
            return
        tensor_key = tuple(
            (a.dtype, a.data_ptr() % 16 == 0) for a in args if isinstance(a, torch.Tensor)
        )
        device = args[0].device.index
        key = (device, tensor_key, tuple(constexprs.values()), num_warps, num_stages)
        compiled = self.compiled.get(key)
        if compiled is None:
            self._check_integers_unspecialized(args)
            self.compiled[key] = self.kernel[grid](
                *args, **constexprs, num_warps=num_warps, num_stages=num_stages
            )
            return
        grid_y = grid[1] if len(grid) > 1 else 1
        grid_z = grid[2] if len(grid) > 2 else 1
        compiled.run(
            grid[0], grid_y, grid_z,
            triton.runtime.driver.active.get_current_stream(device),
            compiled.function, compiled.packed_metadata, None, None, None,
            *args, *(constexprs[name] for name in self.constexpr_names),
        )

    def _check_integers_unspecialized(self, args: tuple) -> None:
        """A specialised integer (== 1, % 16) would be baked into the cached kernel."""
        for index, arg in enumerate(args):
            is_int = isinstance(arg, int) and not isinstance(arg, bool)
            if is_int and index not in self.unspecialized:
                raise TypeError(
                    f"{self.kernel}: integer argument {index} must be a constexpr or listed in "
                    "do_not_specialize to be launched through CachedLauncher"
                )
