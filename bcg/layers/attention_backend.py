"""Attention backends: the arithmetic of paged attention, chosen once when the engine starts.

A backend stores the new keys and values of a step's live tokens into the paged cache and
writes their causal attention over each sequence (cached prefix + new tokens) into an
output. It owns the metadata every layer of a step reuses (`metadata(batch)`, built by the
runner once per step or once per decode graph bucket and carried in the forward context),
so no layer allocates its own. `TritonAttention` runs our kernels on CUDA;
`ReferenceAttention` is plain PyTorch (the CPU path and the tests' oracle).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple, Protocol

import torch

from bcg.forward import ForwardBatch, ForwardContext, KVStore
from bcg.layers import triton_ops
from bcg.layers.attention_ref import paged_attention_ref
from bcg.layers.attention_ref import store_kv as store_kv_ref


class AttentionLayer(Protocol):
    layer_id: int  # which layer's KV cache to use
    scale: float  # softmax scale


class AttentionBackend(ABC):
    def metadata(self, batch: ForwardBatch) -> Any:
        """What every layer reuses while the stack runs on `batch` (None: nothing)."""
        return None

    def kv_store_target(self, layer: AttentionLayer, v: torch.Tensor,
                        context: ForwardContext) -> KVStore | None:
        """Where the rotary kernel may store this step's keys and values itself (the
        backend then skips its own store); None: the backend stores them."""
        return None

    @abstractmethod
    def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, out: torch.Tensor, context: ForwardContext,
                kv_stored: bool = False) -> None:
        """q, out `[T, H, D]`, k, v `[T, KVH, D]`, T = the batch's live token count: store
        k, v at `context.batch.slot_mapping` (unless `kv_stored`: rotary stored them), then
        write the attention of q into `out`."""


class ReferenceAttention(AttentionBackend):
    def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, out: torch.Tensor, context: ForwardContext,
                kv_stored: bool = False) -> None:
        assert not kv_stored, "the reference offers no store to rotary"
        batch = context.batch
        k_cache, v_cache = context.kv_cache.layer(layer.layer_id)
        store_kv_ref(k, v, k_cache, v_cache, batch.slot_mapping[: batch.num_tokens])
        paged_attention_ref(q, k_cache, v_cache, batch.cu_seqlens_q, batch.seq_lens,
                            batch.block_tables, layer.scale, out=out)


class MixedStepMetadata(NamedTuple):
    """A mixed step's split: its leading one-token rows go through the decode kernel (split
    over the KV, one query row per head, where the extend kernel would pad each to a full
    query tile and walk the KV in one program), the rest through the extend kernel."""

    decode_plan: Any  # the decode kernel's plan for the leading rows
    extend_cu_seqlens_q: torch.Tensor  # the other rows' new-token offsets, from 0


class TritonAttention(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 device: torch.device) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.device = device
        self._decode_plans: dict[int, Any] = {}

    def metadata(self, batch: ForwardBatch) -> Any:
        """A decode batch's decode plan, a mixed one's `MixedStepMetadata`, else None."""
        if batch.is_decode:
            return self._decode_plan(batch.num_seqs)
        num_decode = batch.num_decode_seqs
        if num_decode == 0:
            return None
        return MixedStepMetadata(self._decode_plan(num_decode),
                                 batch.cu_seqlens_q[num_decode:] - num_decode)

    def _decode_plan(self, num_seqs: int) -> Any:
        """The decode kernel's split count and workspace: one per power-of-two batch size
        (or the most rows the kernel takes, which max_num_seqs stays within), shared by all
        layers and steps (and by the decode graphs of that size and mixed steps, which
        never run at once)."""
        size = min(1 << (num_seqs - 1).bit_length(), triton_ops.MAX_DECODE_ROWS)
        if size not in self._decode_plans:
            self._decode_plans[size] = triton_ops.plan_decode(
                size, self.num_heads, self.num_kv_heads, self.head_dim, self.device)
        return self._decode_plans[size]

    def kv_store_target(self, layer: AttentionLayer, v: torch.Tensor,
                        context: ForwardContext) -> KVStore | None:
        """A decode step's: one launch less per layer. Not a prefill's, and none while a
        prefill graph is captured (even of a one-token bucket): its segments serve any later
        batch and are captured before the cache exists, so its attention break stores."""
        if not (context.rotary_may_store_kv and context.batch.is_decode):
            return None
        return (v, *context.kv_cache.layer(layer.layer_id), context.batch.slot_mapping)

    def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, out: torch.Tensor, context: ForwardContext,
                kv_stored: bool = False) -> None:
        batch = context.batch
        k_cache, v_cache = context.kv_cache.layer(layer.layer_id)
        if not kv_stored:
            triton_ops.store_kv(k, v, k_cache, v_cache, batch.slot_mapping[: batch.num_tokens])
        metadata = context.attention_metadata
        if batch.is_decode:
            triton_ops.decode_attention(q, k_cache, v_cache, batch.seq_lens, batch.block_tables,
                                        layer.scale, out=out, plan=metadata)
        elif metadata is None:
            triton_ops.extend_attention(q, k_cache, v_cache, batch.cu_seqlens_q, batch.seq_lens,
                                        batch.block_tables, layer.scale, out=out)
        else:
            n = batch.num_decode_seqs  # one token each: also the first n rows of q
            triton_ops.decode_attention(q[:n], k_cache, v_cache, batch.seq_lens[:n],
                                        batch.block_tables[:n], layer.scale, out=out[:n],
                                        plan=metadata.decode_plan)
            triton_ops.extend_attention(q[n:], k_cache, v_cache, metadata.extend_cu_seqlens_q,
                                        batch.seq_lens[n:], batch.block_tables[n:],
                                        layer.scale, out=out[n:])


def attention_backend(device: torch.device, num_heads: int, num_kv_heads: int,
                      head_dim: int) -> AttentionBackend:
    """Triton's kernels on CUDA, the PyTorch reference elsewhere."""
    if triton_ops.uses_triton(device):
        return TritonAttention(num_heads, num_kv_heads, head_dim, device)
    return ReferenceAttention()
