"""Paged decode attention: one new token per sequence, split-KV, safe inside a CUDA graph.

Each sequence's KV range is cut into ``num_splits`` chunks so that one long sequence still
fills the GPU. The split count is fixed per batch size (``plan_decode``) and the chunk length
is computed on the GPU from ``seq_lens``, so the grid never depends on data: a captured graph
replays correctly with any lengths and block tables. Each split writes a normalised partial
output and its log-sum-exp; the last split of a (row, KV head) to finish, found by an atomic
count, merges them in the same launch (one kernel, not a second merge launch, per layer). A
row whose ``seq_len`` is 0 (a padded slot of a graph bucket) reads nothing and leaves its
output untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from bcg.kernels import _pdl
from bcg.kernels._attention_tile import LOG2_E, attend_kv_range, paged_attention_layout
from bcg.kernels._launch import (
    PROGRAMS_PER_SM,
    CachedLauncher,
    DeviceConfigs,
    multiprocessor_count,
    next_power_of_2,
)
from bcg.utils import cdiv

# Past this, merge work and per-split overhead outweigh the extra parallelism (on an H100,
# 32 to 128 splits of one 32k sequence run within 5% of each other); a power of two, the
# merge's width.
MAX_SPLITS = 64
# fp32 partial-output values the merging split loads at a time (32 a thread of 4 warps;
# head_dim is a power of two, as the tiles need).
MERGE_LOAD_VALUES = 4096
MAX_GRID_ROWS = 65535  # rows run on the grid's second axis, which CUDA caps at this
# tl.dot needs at least 16 rows; the GQA group of one KV head is padded up to this.
MIN_DOT_ROWS = 16


@dataclass(frozen=True)
class DecodeConfig:
    """Tile shape of the split kernel: KV tokens per step, warps, pipeline stages."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


# Tuned on the H100 (32/8 and 16/8 heads, head_dim 128, in CUDA graphs): 64-token tiles
# match or beat 32-token ones at every batch and context; from LARGE_BATCH rows up, where
# sequences of mixed lengths share the GPU (offline batches), 128-token tiles run another
# 2-5% faster, but cost 5% on one 32k sequence and 15% on one 512-token one.
CONFIGS = DeviceConfigs(
    gpu=DecodeConfig(), interpreter=DecodeConfig(block_n=16, num_warps=1, num_stages=1)
)
LARGE_BATCH = 32
LARGE_BATCH_CONFIGS = DeviceConfigs(gpu=DecodeConfig(block_n=128), interpreter=CONFIGS.interpreter)


@dataclass(frozen=True)
class DecodePlan:
    """Split count and merge workspace for one batch size, reusable by every layer and step.

    ``partial_out`` is fp32 ``[max_batch, num_heads, num_splits, head_dim]``,
    ``partial_lse`` fp32 ``[max_batch, num_heads, num_splits]`` (log2 units) and ``arrivals``
    int32 ``[max_batch, num_kv_heads]``, the splits of each (row, KV head) done so far: zero
    between calls (the merging split resets it). Nothing in it depends on sequence lengths,
    so a graph runner builds one per captured batch size.
    """

    num_splits: int
    max_batch: int
    num_heads: int
    head_dim: int
    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    arrivals: torch.Tensor
    config: DecodeConfig


def plan_decode(
    batch_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device | str,
    config: DecodeConfig | None = None,
    num_splits: int | None = None,
) -> DecodePlan:
    """Choose the split count for ``batch_size`` rows and allocate the merge workspace.

    By default splits are chosen so that ``batch_size * num_kv_heads * num_splits`` programs
    cover every multiprocessor a few times over, capped at ``MAX_SPLITS``, and the tiles
    follow the batch size; ``num_splits`` and ``config`` override the choice (tuning, tests).
    """
    device = torch.device(device)
    configs = LARGE_BATCH_CONFIGS if batch_size >= LARGE_BATCH else CONFIGS
    config = config or configs.for_device(device.type == "cuda")
    if batch_size > MAX_GRID_ROWS:
        raise ValueError(f"decode attention takes at most {MAX_GRID_ROWS} rows a call (a CUDA "
                         f"grid's second axis), got {batch_size}: lower max_num_seqs")
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}] (the merge reads at most "
                         f"{MAX_SPLITS} partials), got {num_splits}")
    if num_splits is None:
        target_programs = PROGRAMS_PER_SM * multiprocessor_count(device)
        num_splits = cdiv(target_programs, batch_size * num_kv_heads)
        num_splits = min(MAX_SPLITS, max(1, num_splits))
    partial_out = torch.empty(
        batch_size, num_heads, num_splits, head_dim, dtype=torch.float32, device=device
    )
    partial_lse = torch.empty(batch_size, num_heads, num_splits, dtype=torch.float32, device=device)
    arrivals = torch.zeros(batch_size, num_kv_heads, dtype=torch.int32, device=device)
    return DecodePlan(
        num_splits, batch_size, num_heads, head_dim, partial_out, partial_lse, arrivals, config
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    plan: DecodePlan | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged KV (new token included).

    Args:
        q: ``[batch, num_heads, head_dim]`` bf16/fp16/fp32, last dim contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, same dtype.
        seq_lens: int32 ``[batch]``, KV length of each row including the new token; 0 marks
            a padded row, which is skipped.
        block_tables: int32 ``[batch, max_blocks]``.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        out: ``[batch, num_heads, head_dim]`` to write into (allocated if None).
        plan: from ``plan_decode`` for at least ``batch`` rows; built here if None (that
            allocates, so pass one inside graph capture and on hot paths).

    Returns ``out``. No host synchronisation: safe to capture in a CUDA graph.
    """
    out, block_size, num_kv_heads, group, strides = paged_attention_layout(
        q, k_cache, v_cache, out
    )
    batch, num_heads, head_dim = q.shape
    if plan is None:
        plan = plan_decode(batch, num_heads, num_kv_heads, head_dim, q.device)
    if (plan.max_batch < batch or (plan.num_heads, plan.head_dim) != (num_heads, head_dim)
            or plan.arrivals.shape[1] != num_kv_heads):
        raise ValueError(
            f"plan is for up to {plan.max_batch} rows of {plan.num_heads} heads x "
            f"{plan.head_dim}, not q {tuple(q.shape)}: build a fitting one with plan_decode()"
        )
    config = plan.config
    # KV heads on the fastest grid axis: a row's heads, 256 B apart in each cache slot at
    # head_dim 128, are read at about the same time (1-2% at 128-256 mixed-length rows).
    _launch_split(
        (num_kv_heads, batch, plan.num_splits),
        (q, k_cache, v_cache, seq_lens, block_tables, out, plan.partial_out, plan.partial_lse,
         plan.arrivals),
        (scale * LOG2_E, plan.num_splits, block_tables.stride(0)),
        {
            **strides,
            "NUM_HEADS": num_heads,
            "GROUP": group,
            "BLOCK_H": max(MIN_DOT_ROWS, next_power_of_2(group)),
            "HEAD_DIM": head_dim,
            "PAGE": block_size,
            "BLOCK_N": config.block_n,
            "GROUP_P2": next_power_of_2(group),
            "MAX_SPLITS": MAX_SPLITS,
            "SPLITS_PER_LOAD": max(1, MERGE_LOAD_VALUES // (next_power_of_2(group) * head_dim)),
            "PDL": _pdl.launches_early(q.device),
        },
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


@triton.jit
def _split_chunk(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """KV tokens per split: an even share of ``seq_len`` rounded up to whole tiles."""
    per_split = tl.cdiv(seq_len, num_splits)
    return tl.maximum(tl.cdiv(per_split, BLOCK_N), 1) * BLOCK_N


@triton.jit
def _merge_splits(partial_out_ptr, partial_lse_ptr, first_row, num_splits, num_used,
                  GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                  MAX_SPLITS: tl.constexpr, SPLITS_PER_LOAD: tl.constexpr):
    """The ``num_used`` partial outputs of each of the ``GROUP`` heads whose workspace rows
    start at ``first_row`` (``num_splits`` rows a head), weighted by their log-sum-exps: the
    attention over the whole sequence, ``[GROUP_P2, HEAD_DIM]`` (padded heads zero).
    ``SPLITS_PER_LOAD`` partials of every head arrive in one load: loading one split at a
    time paid the L2 latency per split, most of a long sequence's decode time. Read past
    the L1 cache, which other multiprocessors' writes do not reach."""
    heads = tl.arange(0, GROUP_P2)
    head_rows = first_row + heads * num_splits
    head_mask = heads < GROUP
    # Every split's log-sum-exp in one load: the weights' maximum and sum up front (a
    # running maximum, rescaling the sum at each load, ran 4% slower at batch 64).
    splits = tl.arange(0, MAX_SPLITS)
    lse = tl.load(partial_lse_ptr + head_rows[:, None] + splits[None, :],
                  mask=head_mask[:, None] & (splits[None, :] < num_used), other=float("-inf"),
                  cache_modifier=".cg")
    top = tl.where(head_mask, tl.max(lse, 1), 0.0)  # padded heads: finite, weigh nothing
    total = tl.where(head_mask, tl.sum(tl.exp2(lse - top[:, None]), 1), 1.0)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([GROUP_P2, HEAD_DIM], tl.float32)
    for first in range(0, num_used, SPLITS_PER_LOAD):
        some = first + tl.arange(0, SPLITS_PER_LOAD)
        rows = head_rows[:, None] + some[None, :]
        mask = head_mask[:, None] & (some[None, :] < num_used)
        weight = tl.exp2(tl.load(partial_lse_ptr + rows, mask=mask, other=float("-inf"),
                                 cache_modifier=".cg") - top[:, None])
        part = tl.load(partial_out_ptr + rows[:, :, None] * HEAD_DIM + dims[None, None, :],
                       mask=mask[:, :, None], other=0.0, cache_modifier=".cg")
        acc += tl.sum(part * weight[:, :, None], 1)
    return acc / total[:, None]


@triton.jit(do_not_specialize=["num_splits", "stride_table"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, seq_lens_ptr, block_tables_ptr,
    out_ptr, partial_out_ptr, partial_lse_ptr, arrivals_ptr,
    scale_log2, num_splits, stride_table,
    STRIDE_Q_TOK: tl.constexpr,
    STRIDE_Q_HEAD: tl.constexpr,
    STRIDE_CACHE_BLOCK: tl.constexpr,
    STRIDE_CACHE_SLOT: tl.constexpr,
    STRIDE_CACHE_HEAD: tl.constexpr,
    STRIDE_OUT_TOK: tl.constexpr,
    STRIDE_OUT_HEAD: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_P2: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    SPLITS_PER_LOAD: tl.constexpr,
    PDL: tl.constexpr,
):
    # The o projection starts only as these programs exit: launched while they run, its
    # programs doubled up on the free multiprocessors and ran 1.5x longer (qwen3-8b, H200).
    _pdl.wait_for_previous(PDL)
    kv_head = tl.program_id(0)
    row = tl.program_id(1)
    split = tl.program_id(2)
    group_idx = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + group_idx
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + row * STRIDE_Q_TOK + heads[:, None] * STRIDE_Q_HEAD + dims[None, :],
                mask=(group_idx < GROUP)[:, None], other=0.0)
    attend_split(
        q, kv_head, row, split, tl.load(seq_lens_ptr + row), k_cache_ptr, v_cache_ptr,
        block_tables_ptr + row.to(tl.int64) * stride_table, out_ptr, partial_out_ptr,
        partial_lse_ptr, arrivals_ptr, scale_log2, num_splits, STRIDE_CACHE_BLOCK,
        STRIDE_CACHE_SLOT, STRIDE_CACHE_HEAD, STRIDE_OUT_TOK, STRIDE_OUT_HEAD, NUM_HEADS, GROUP,
        BLOCK_H, HEAD_DIM, PAGE, BLOCK_N, GROUP_P2, MAX_SPLITS, SPLITS_PER_LOAD,
    )


@triton.jit
def attend_split(
    q, kv_head, row, split, seq_len, k_cache_ptr, v_cache_ptr, table_ptr,
    out_ptr, partial_out_ptr, partial_lse_ptr, arrivals_ptr, scale_log2, num_splits,
    STRIDE_CACHE_BLOCK: tl.constexpr,
    STRIDE_CACHE_SLOT: tl.constexpr,
    STRIDE_CACHE_HEAD: tl.constexpr,
    STRIDE_OUT_TOK: tl.constexpr,
    STRIDE_OUT_HEAD: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_P2: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    SPLITS_PER_LOAD: tl.constexpr,
):
    """Split ``split`` of row ``row``'s KV (``seq_len`` tokens, pages at ``table_ptr``) for
    the query heads of ``kv_head``: ``q`` ``[BLOCK_H, HEAD_DIM]``, its rows past ``GROUP``
    zero. The attention of those heads goes to ``out_ptr``, merged over the splits by the
    last one in; a split past the sequence does nothing (the decode kernel's body, shared
    with the fused decode stack)."""
    chunk = _split_chunk(seq_len, num_splits, BLOCK_N)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    if start < end:
        group_idx = tl.arange(0, BLOCK_H)
        heads = kv_head * GROUP + group_idx
        head_mask = group_idx < GROUP
        dims = tl.arange(0, HEAD_DIM)
        head_offset = kv_head * STRIDE_CACHE_HEAD
        # Every row sees the whole chunk: only the ragged last tile needs a mask.
        last_pos = tl.full([BLOCK_H], 0, tl.int32) + end - 1
        whole_tiles_end = start + (end - start) // BLOCK_N * BLOCK_N

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
        acc, l_i, m_i = attend_kv_range(
            acc, l_i, m_i, q, last_pos, k_cache_ptr, v_cache_ptr, table_ptr, head_offset,
            start, whole_tiles_end, scale_log2, STRIDE_CACHE_BLOCK, STRIDE_CACHE_SLOT,
            HEAD_DIM, PAGE, BLOCK_N, False,
        )
        acc, l_i, m_i = attend_kv_range(
            acc, l_i, m_i, q, last_pos, k_cache_ptr, v_cache_ptr, table_ptr, head_offset,
            whole_tiles_end, end, scale_log2, STRIDE_CACHE_BLOCK, STRIDE_CACHE_SLOT,
            HEAD_DIM, PAGE, BLOCK_N, True,
        )

        result = acc / l_i[:, None]
        out_ptrs = (out_ptr + row * STRIDE_OUT_TOK + heads[:, None] * STRIDE_OUT_HEAD
                    + dims[None, :])
        # A runtime branch, not a constexpr: the splits in use follow the sequence length (a
        # sequence within one split's chunk needs no merge, whatever the split count).
        num_used = tl.cdiv(seq_len, chunk)
        if num_used == 1:
            tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=head_mask[:, None])
        else:
            # The plan's workspace is contiguous [batch, heads, splits, (head_dim)].
            first_rows = (row * NUM_HEADS + heads) * num_splits
            partial_ptrs = (partial_out_ptr + (first_rows + split)[:, None] * HEAD_DIM
                            + dims[None, :])
            tl.store(partial_ptrs, result, mask=head_mask[:, None])
            tl.store(partial_lse_ptr + first_rows + split, m_i + tl.log2(l_i), mask=head_mask)
            # Release these partials, then count this split in; the last one in merges them.
            # The barrier first: one thread does the atomic, and its release must cover
            # every thread's stores.
            tl.debug_barrier()
            arrival_ptr = arrivals_ptr + row * (NUM_HEADS // GROUP) + kv_head
            arrived = tl.atomic_add(arrival_ptr, 1, sem="acq_rel")
            if arrived == num_used - 1:
                tl.debug_barrier()  # every thread's reads after the one thread's acquire
                merged = _merge_splits(partial_out_ptr, partial_lse_ptr,
                                       (row * NUM_HEADS + kv_head * GROUP) * num_splits,
                                       num_splits, num_used, GROUP, GROUP_P2, HEAD_DIM,
                                       MAX_SPLITS, SPLITS_PER_LOAD)
                group_heads = tl.arange(0, GROUP_P2)
                merged_ptrs = (out_ptr + row * STRIDE_OUT_TOK
                               + (kv_head * GROUP + group_heads)[:, None] * STRIDE_OUT_HEAD
                               + dims[None, :])
                tl.store(merged_ptrs, merged.to(out_ptr.dtype.element_ty),
                         mask=(group_heads < GROUP)[:, None])
                tl.store(arrival_ptr, 0)  # ready for the next call (the next layer, a replay)


_launch_split = CachedLauncher(_decode_split_kernel)
