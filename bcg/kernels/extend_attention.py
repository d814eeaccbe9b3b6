"""Extend (prefill) attention: a varlen batch of new tokens over each sequence's paged KV.

The new tokens' keys and values must already be in the cache (``store_kv`` first). Token i
of a sequence with ``q_len`` new tokens and ``seq_len`` KV positions sees positions
``<= seq_len - q_len + i``: the cached prefix whole, the new tokens causally.

One program handles one KV head and a tile of ``BLOCK_M // group`` consecutive tokens of one
sequence with all ``group`` query heads that share that KV head, so each KV tile is read once
per group. Programs find their (sequence, token tile) from ``cu_seqlens_q`` on the GPU, so
there is no per-step metadata to build: the grid depends only on tensor shapes (an upper
bound on the tile count), the call never synchronises with the host and is safe to capture.
That lookup scans ``cu_seqlens_q`` in chunks of a fixed width up to a runtime bound, so no
constexpr depends on the batch: one compiled kernel serves every number of sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from bcg.kernels._attention_tile import LOG2_E, attend_kv_range, paged_attention_layout
from bcg.kernels._launch import (
    CachedLauncher,
    DeviceConfigs,
)
from bcg.utils import cdiv


@dataclass(frozen=True)
class ExtendConfig:
    """Tile shape: query rows (tokens x group heads) and KV tokens per step, warps, stages;
    and how many sequences a program's tile lookup reads per step (a power of two)."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 2
    seq_chunk: int = 64


CONFIGS = DeviceConfigs(
    gpu=ExtendConfig(),
    interpreter=ExtendConfig(block_m=32, block_n=16, num_warps=1, num_stages=1, seq_chunk=8),
)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    config: ExtendConfig | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens over their sequences' paged KV (prefix + themselves).

    Args:
        q: ``[num_tokens, num_heads, head_dim]`` bf16/fp16/fp32, last dim contiguous. Tokens
            past ``cu_seqlens_q[-1]`` (padding of a graph bucket) are ignored.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, holding the
            new tokens' keys/values too.
        cu_seqlens_q: int32 ``[num_seqs + 1]``, new-token offsets of each sequence in ``q``.
        seq_lens: int32 ``[num_seqs]``, KV length of each sequence including its new tokens.
        block_tables: int32 ``[num_seqs, max_blocks]``.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        out: ``[num_tokens, num_heads, head_dim]`` to write into (allocated if None); rows of
            padding tokens are left untouched.
        config: tile shape override (tuning); the default suits the device.

    Returns ``out``.
    """
    out, block_size, num_kv_heads, group, strides = paged_attention_layout(
        q, k_cache, v_cache, out
    )
    num_tokens, num_heads, head_dim = q.shape
    config = config or CONFIGS.for_device(q.is_cuda)
    if group > config.block_m:
        raise ValueError(
            f"{group} query heads per KV head exceed the tile of {config.block_m} rows; "
            "pass an ExtendConfig with a larger block_m"
        )
    num_seqs = seq_lens.shape[0]
    tokens_per_tile = config.block_m // group
    # Every sequence wastes at most one partial tile, so this bounds the tile count.
    max_tiles = cdiv(num_tokens, tokens_per_tile) + num_seqs
    _launch_extend(
        (max_tiles, num_kv_heads),
        (q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out),
        (scale * LOG2_E, num_seqs, max_tiles, block_tables.stride(0)),
        {
            **strides,
            "GROUP": group,
            "TOKENS_PER_TILE": tokens_per_tile,
            "SEQ_CHUNK": config.seq_chunk,
            "HEAD_DIM": head_dim,
            "PAGE": block_size,
            "BLOCK_M": config.block_m,
            "BLOCK_N": config.block_n,
        },
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


@triton.jit
def _locate_tile(
    cu_seqlens_q_ptr, num_seqs, tile, TOKENS_PER_TILE: tl.constexpr, SEQ_CHUNK: tl.constexpr
):
    """(sequence, index of its first tile) of ``tile``; the sequence is ``num_seqs`` for a
    tile past the batch's last.

    Scans ``SEQ_CHUNK`` sequences at a time and stops at the chunk holding ``tile``.
    """
    seq = 0
    seq_first_tile = 0
    tiles_before = 0
    chunk_start = 0
    while (chunk_start < num_seqs) & (tiles_before <= tile):
        seqs = chunk_start + tl.arange(0, SEQ_CHUNK)
        is_seq = seqs < num_seqs
        q_starts = tl.load(cu_seqlens_q_ptr + seqs, mask=is_seq, other=0)
        q_ends = tl.load(cu_seqlens_q_ptr + seqs + 1, mask=is_seq, other=0)
        tiles_per_seq = tl.cdiv(q_ends - q_starts, TOKENS_PER_TILE)
        tiles_through = tiles_before + tl.cumsum(tiles_per_seq, 0)
        ended_before_tile = is_seq & (tiles_through <= tile)
        seq += tl.sum(ended_before_tile.to(tl.int32), 0)
        seq_first_tile = tl.maximum(
            seq_first_tile, tl.max(tl.where(ended_before_tile, tiles_through, 0), 0)
        )
        tiles_before += tl.sum(tiles_per_seq, 0)
        chunk_start += SEQ_CHUNK
    return seq, seq_first_tile


@triton.jit(do_not_specialize=["num_seqs", "max_tiles", "stride_table"])
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr, out_ptr,
    scale_log2, num_seqs, max_tiles, stride_table,
    STRIDE_Q_TOK: tl.constexpr,
    STRIDE_Q_HEAD: tl.constexpr,
    STRIDE_CACHE_BLOCK: tl.constexpr,
    STRIDE_CACHE_SLOT: tl.constexpr,
    STRIDE_CACHE_HEAD: tl.constexpr,
    STRIDE_OUT_TOK: tl.constexpr,
    STRIDE_OUT_HEAD: tl.constexpr,
    GROUP: tl.constexpr,
    TOKENS_PER_TILE: tl.constexpr,
    SEQ_CHUNK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Reverse order: a sequence's last tiles see the most KV, so they start first.
    tile = max_tiles - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)

    seq, seq_first_tile = _locate_tile(cu_seqlens_q_ptr, num_seqs, tile, TOKENS_PER_TILE, SEQ_CHUNK)
    if seq >= num_seqs:
        return
    first_token = (tile - seq_first_tile) * TOKENS_PER_TILE
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tokens = first_token + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_mask = (rows < TOKENS_PER_TILE * GROUP) & (tokens < q_len)
    dims = tl.arange(0, HEAD_DIM)
    token_rows = (q_start + tokens).to(tl.int64)
    q = tl.load(
        q_ptr + token_rows[:, None] * STRIDE_Q_TOK + heads[:, None] * STRIDE_Q_HEAD + dims[None, :],
        mask=row_mask[:, None],
        other=0.0,
    )
    q_pos = prefix_len + tokens
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table
    head_offset = kv_head * STRIDE_CACHE_HEAD
    # Positions up to prefix_len + first_token are visible to every row: no mask there.
    unmasked_end = (prefix_len + first_token + 1) // BLOCK_N * BLOCK_N
    kv_end = prefix_len + tl.minimum(first_token + TOKENS_PER_TILE, q_len)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    acc, l_i, m_i = attend_kv_range(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, table_ptr, head_offset,
        0, unmasked_end, scale_log2, STRIDE_CACHE_BLOCK, STRIDE_CACHE_SLOT,
        HEAD_DIM, PAGE, BLOCK_N, False,
    )
    acc, l_i, m_i = attend_kv_range(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, table_ptr, head_offset,
        unmasked_end, kv_end, scale_log2, STRIDE_CACHE_BLOCK, STRIDE_CACHE_SLOT,
        HEAD_DIM, PAGE, BLOCK_N, True,
    )

    out_ptrs = (
        out_ptr + token_rows[:, None] * STRIDE_OUT_TOK + heads[:, None] * STRIDE_OUT_HEAD
        + dims[None, :]
    )
    result = acc / l_i[:, None]
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


_launch_extend = CachedLauncher(_extend_kernel)
