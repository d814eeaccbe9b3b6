"""Write new tokens' keys and values into their paged-cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bcg.kernels._launch import (
    CachedLauncher,
    next_power_of_2,
)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Copy ``k``, ``v`` into ``k_cache``, ``v_cache`` at ``slot_mapping``, in place.

    Args:
        k, v: ``[num_tokens, num_kv_heads, head_dim]``, last dim contiguous (views into a
            fused qkv projection are fine).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, same dtype,
            contiguous.
        slot_mapping: int64 ``[num_tokens]``, ``block_id * block_size + offset``; a negative
            slot (padding) writes nothing.

    One launch, no host synchronisation: safe to capture in a CUDA graph.
    """
    check_kv_store(k, v, k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = k.shape
    k_strides, v_strides = k.stride(), v.stride()
    if num_tokens == 0:
        return
    _launch_store_kv(
        (num_tokens,),
        (k, v, k_cache, v_cache, slot_mapping),
        (),
        {
            "STRIDE_K_TOK": k_strides[0],
            "STRIDE_K_HEAD": k_strides[1],
            "STRIDE_V_TOK": v_strides[0],
            "STRIDE_V_HEAD": v_strides[1],
            "STRIDE_SLOT": k_cache.stride(1),
            "NUM_KV_HEADS": num_kv_heads,
            "HEADS_PAD": next_power_of_2(num_kv_heads),
            "HEAD_DIM": head_dim,
        },
    )


def check_kv_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor) -> None:
    """Raise unless ``k``, ``v`` and the caches have ``store_kv``'s layouts."""
    _, num_kv_heads, head_dim = k.shape
    cache_shape, cache_strides = k_cache.shape, k_cache.stride()
    if cache_shape[2:] != (num_kv_heads, head_dim) or cache_shape != v_cache.shape:
        raise ValueError(
            f"k {tuple(k.shape)} does not fit caches {tuple(cache_shape)} / "
            f"{tuple(v_cache.shape)} [blocks, block_size, kv_heads, head_dim]"
        )
    # Slots are addressed as one flat index, so blocks, slots and heads must be dense.
    dense = cache_strides == (cache_shape[1] * num_kv_heads * head_dim,
                              num_kv_heads * head_dim, head_dim, 1)
    if not dense or cache_strides != v_cache.stride():
        raise ValueError(
            f"k_cache and v_cache must be contiguous with equal strides, got {cache_strides} "
            f"and {v_cache.stride()}; allocate them with torch.empty"
        )
    if k.stride(2) != 1 or v.stride(2) != 1 or v.shape != k.shape:
        raise ValueError(f"k and v need equal shapes and a contiguous last dimension, got "
                         f"{tuple(k.shape)} {k.stride()} and {tuple(v.shape)} {v.stride()}")


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    STRIDE_K_TOK: tl.constexpr,
    STRIDE_K_HEAD: tl.constexpr,
    STRIDE_V_TOK: tl.constexpr,
    STRIDE_V_HEAD: tl.constexpr,
    STRIDE_SLOT: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    mask = (heads < NUM_KV_HEADS)[:, None]
    cache_offsets = slot * STRIDE_SLOT + heads[:, None] * HEAD_DIM + dims[None, :]
    k_offsets = token * STRIDE_K_TOK + heads[:, None] * STRIDE_K_HEAD + dims[None, :]
    v_offsets = token * STRIDE_V_TOK + heads[:, None] * STRIDE_V_HEAD + dims[None, :]
    tl.store(k_cache_ptr + cache_offsets, tl.load(k_ptr + k_offsets, mask=mask), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, tl.load(v_ptr + v_offsets, mask=mask), mask=mask)


_launch_store_kv = CachedLauncher(_store_kv_kernel)
