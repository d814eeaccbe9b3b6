"""Paged KV layouts built by hand for the attention tests: the one way they scatter each
sequence's blocks over a shuffled pool, and the cache slots of its positions (torch only)."""

from __future__ import annotations

import torch


def scatter_blocks(
    blocks_per_seq: list[int], num_blocks: int, generator: torch.Generator
) -> torch.Tensor:
    """Block tables (int32) giving each sequence its blocks from a shuffled pool of
    `num_blocks`, rows padded with -1 to the widest (the rest of the pool is never used)."""
    if num_blocks < sum(blocks_per_seq):
        raise ValueError(f"{num_blocks} blocks cannot hold {sum(blocks_per_seq)}")
    order = torch.randperm(num_blocks, generator=generator).tolist()
    width = max(blocks_per_seq, default=0)
    tables, start = [], 0
    for count in blocks_per_seq:
        tables.append(order[start : start + count] + [-1] * (width - count))
        start += count
    return torch.tensor(tables, dtype=torch.int32).view(len(blocks_per_seq), width)


def slot_mapping(table: torch.Tensor, positions: range, block_size: int) -> torch.Tensor:
    """The cache slots (int64) of `positions` in a sequence whose block table row is `table`."""
    pos = torch.tensor(positions, dtype=torch.int64)
    return table.long()[pos // block_size] * block_size + pos % block_size
