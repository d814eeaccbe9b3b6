"""Reference paged attention in plain PyTorch (CPU and GPU).

Layout shared with the Triton kernels:
- KV cache of one layer: `k_cache`, `v_cache` `[num_blocks, block_size, num_kv_heads, head_dim]`.
- `slot_mapping` int64 `[num_tokens]`: slot = block_id * block_size + offset; negative = skip.
- `cu_seqlens_q` int32 `[num_seqs + 1]`: new-token offsets of each sequence in `q`.
- `seq_lens` int32 `[num_seqs]`: KV length of each sequence including its new tokens, so the
  cached prefix of sequence i is `seq_lens[i] - (cu_seqlens_q[i + 1] - cu_seqlens_q[i])`.
- `block_tables` int32 `[num_seqs, max_blocks]`: the cache blocks of each sequence, in order.

Written for clarity, not speed: one host sync per call and a Python loop over sequences.
"""

from __future__ import annotations

import torch

from bcg.utils import cdiv


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write `k`, `v` `[num_tokens, num_kv_heads, head_dim]` into their cache slots."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens `q` `[num_tokens, num_heads, head_dim]` over each
    sequence's paged KV (cached prefix + new tokens). Rows of `q` past `cu_seqlens_q[-1]`
    are neither read nor written."""
    if out is None:
        out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if end == start or seq_len == 0:
            continue
        k, v = _gather_kv(k_cache, v_cache, block_tables[i], seq_len)
        out[start:end] = _causal_attention(q[start:end], k, v, scale).to(out.dtype)
    return out


def _gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    block_size = k_cache.shape[1]
    blocks = block_table[: cdiv(seq_len, block_size)].long()
    k = k_cache[blocks].flatten(0, 1)[:seq_len]
    v = v_cache[blocks].flatten(0, 1)[:seq_len]
    return k, v


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q `[n, H, D]` are the last n of the `S` positions in k, v `[S, KVH, D]`; fp32 math."""
    n, num_heads, head_dim = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    qg = q.float().view(n, num_kv_heads, group, head_dim)
    scores = torch.einsum("nhgd,shd->hgns", qg, k.float()) * scale
    query_pos = torch.arange(seq_len - n, seq_len, device=q.device)
    key_pos = torch.arange(seq_len, device=q.device)
    scores.masked_fill_(key_pos[None, :] > query_pos[:, None], float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("hgns,shd->nhgd", probs, v.float()).reshape(n, num_heads, head_dim)
