"""The inner loop shared by the decode and extend attention kernels."""

import triton
import triton.language as tl


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
