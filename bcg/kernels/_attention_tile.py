"""What the decode and extend attention kernels share: argument checks and the inner loop."""

import torch
import triton
import triton.language as tl

from bcg.kernels._launch import last_dim_not_contiguous

# Scores are kept in log2 units so the softmax can use exp2.
LOG2_E = 1.4426950408889634


def paged_attention_layout(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor | None
) -> tuple[torch.Tensor, int, int, int, dict[str, int]]:
    """Validate what both attention kernels take; returns (out, block_size, num_kv_heads,
    group, strides), ``out`` allocated like ``q`` if None.

    ``q`` and ``out`` are ``[num_tokens, num_heads, head_dim]``; each cache is
    ``[num_blocks, block_size, num_kv_heads, head_dim]``, both with the same strides.
    ``strides`` are the ``STRIDE_*`` constexprs both kernels take first, in their order.
    Runs on every attention call, so each tensor's shape and strides are read once.
    """
    q_shape, q_strides = q.shape, q.stride()
    cache_shape, cache_strides = k_cache.shape, k_cache.stride()
    if len(q_shape) != 3 or len(cache_shape) != 4:
        raise ValueError(
            f"expected q [tokens, heads, head_dim] and caches [blocks, block_size, kv_heads, "
            f"head_dim], got q {tuple(q_shape)} and k_cache {tuple(cache_shape)}"
        )
    if cache_shape != v_cache.shape or cache_strides != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    _, block_size, num_kv_heads, head_dim = cache_shape
    _, num_heads, q_head_dim = q_shape
    if q_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"q {tuple(q_shape)} does not fit the cache {tuple(cache_shape)}: head_dim must "
            "match and num_heads must be a multiple of num_kv_heads"
        )
    if head_dim & (head_dim - 1) or block_size & (block_size - 1):
        raise ValueError(f"head_dim and block_size must be powers of two, got {cache_shape}")
    if q_strides[2] != 1:
        raise last_dim_not_contiguous("q", q_strides)
    if cache_strides[3] != 1:
        raise ValueError("k_cache and v_cache need a contiguous last dimension")
    if out is None:
        out = torch.empty_like(q)
    out_strides = out.stride()
    if out_strides[2] != 1:
        raise ValueError(f"out needs a contiguous last dimension, got strides {out_strides}")
    strides = {
        "STRIDE_Q_TOK": q_strides[0],
        "STRIDE_Q_HEAD": q_strides[1],
        "STRIDE_CACHE_BLOCK": cache_strides[0],
        "STRIDE_CACHE_SLOT": cache_strides[1],
        "STRIDE_CACHE_HEAD": cache_strides[2],
        "STRIDE_OUT_TOK": out_strides[0],
        "STRIDE_OUT_HEAD": out_strides[1],
    }
    return out, block_size, num_kv_heads, num_heads // num_kv_heads, strides


@triton.jit
def attend_kv_range(
    acc, l_i, m_i, q, q_pos,
    k_cache_ptr, v_cache_ptr, table_ptr, head_offset,
    lo, hi, scale_log2,
    stride_cache_block, stride_cache_slot,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
):
    """Online-softmax update of ``(acc, l_i, m_i)`` with the paged KV positions ``[lo, hi)``.

    ``q`` is ``[rows, HEAD_DIM]``; ``q_pos`` the last KV position each row may see, applied
    only when ``CAUSAL_MASK`` (callers skip it on tiles every row sees whole). Scores are in
    log2 units (``scale_log2`` folds in log2(e)). Positions past ``hi`` are never read.
    """
    dims = tl.arange(0, HEAD_DIM)
    for tile_start in range(lo, hi, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        in_range = positions < hi
        pages = tl.load(table_ptr + positions // PAGE, mask=in_range, other=0).to(tl.int64)
        token_offsets = pages * stride_cache_block + (positions % PAGE) * stride_cache_slot
        kv_offsets = token_offsets[:, None] + head_offset + dims[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=in_range[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale_log2
        if CAUSAL_MASK:
            visible = in_range[None, :] & (positions[None, :] <= q_pos[:, None])
            scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=in_range[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i
