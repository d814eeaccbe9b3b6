"""Small launch helpers shared by the kernel modules."""

from __future__ import annotations

import functools

import torch

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
