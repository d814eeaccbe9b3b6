"""The attention op's small batch over a real ``KVCache``, shared by ``test_attention_op``
and the subprocess in which it hides Triton (so this module needs none)."""

from __future__ import annotations

import torch

from bcg.forward import ForwardBatch, ForwardContext, KVCache, set_forward_context
from bcg.layers.attention import Attention
from bcg.utils import cdiv, leading_single_tokens
from tests.numerics import pad_with_nan
from tests.paged import scatter_blocks, slot_mapping

BLOCK, KV_HEADS, HEADS, DIM = 4, 2, 4, 16


def new_cache(num_blocks: int) -> KVCache:
    """A zeroed one-layer fp32 CPU cache of the attention op's shape."""
    return KVCache(1, num_blocks, BLOCK, KV_HEADS, DIM, torch.float32, torch.device("cpu"))


def copy_cache(cache: KVCache) -> KVCache:
    copy = new_cache(cache.num_blocks)
    copy.storage.copy_(cache.storage)
    return copy


def make_batch(prefix_lens: list[int], new_lens: list[int]) -> tuple[ForwardBatch, KVCache]:
    """Sequences whose prefix K/V are already cached (random), with new tokens to attend."""
    gen = torch.Generator().manual_seed(0)
    seq_lens = [p + n for p, n in zip(prefix_lens, new_lens, strict=True)]
    blocks_per_seq = [cdiv(s, BLOCK) for s in seq_lens]
    cache = new_cache(sum(blocks_per_seq) + 2)
    cache.storage.normal_(generator=gen)
    block_tables = scatter_blocks(blocks_per_seq, cache.num_blocks, gen)
    slots = [slot_mapping(table, range(prefix, seq_len), BLOCK)
             for table, prefix, seq_len in zip(block_tables, prefix_lens, seq_lens, strict=True)]
    cu = [0]
    for n in new_lens:
        cu.append(cu[-1] + n)
    batch = ForwardBatch(
        input_ids=torch.zeros(cu[-1], dtype=torch.int64), positions=torch.zeros(cu[-1]),
        slot_mapping=torch.cat(slots), cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=block_tables,
        sample_indices=torch.tensor([c - 1 for c in cu[1:]]),
        state_slots=torch.full((len(new_lens),), -1, dtype=torch.int32), num_tokens=cu[-1],
        num_seqs=len(new_lens), max_seqlen_q=max(new_lens), max_seq_len=max(seq_lens),
        num_decode_seqs=leading_single_tokens(new_lens))
    return batch, cache


def qkv(num_tokens: int, padding: int = 0) -> list[torch.Tensor]:
    """Random q, k, v of `num_tokens` rows, then `padding` rows of NaN."""
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(num_tokens, h, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS)]
    return [pad_with_nan(t, padding) for t in tensors]


def run(batch: ForwardBatch, cache: KVCache, q, k, v, backend) -> torch.Tensor:
    """The attention layer's output on `batch` through `backend`."""
    context = ForwardContext(batch, cache, backend, backend.metadata(batch))
    with set_forward_context(context):
        return Attention(0, HEADS, KV_HEADS, DIM)(q, k, v)
