"""The forward contract: what a forward pass reads besides its token ids and positions.

The runner builds a `ForwardBatch` once per step and sets a `ForwardContext` around every
forward (eager call or graph replay), so an op behind a graph break, replayed with its
capture-time arguments, still sees the live batch of this step. Graph runners copy the
batch's fields into static buffers of the same names, so the field names are the contract
between the eager runner, the graph runners and the backends. This module imports nothing
else of bcg: layers, backends and runners all build on it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # int64 [num_tokens]: new tokens of all sequences, in order
    positions: torch.Tensor  # int64 [num_tokens]: position of each token in its sequence
    slot_mapping: torch.Tensor  # int64 [num_tokens]: KV cache slot of each token; < 0 skips
    cu_seqlens_q: torch.Tensor  # int32 [num_seqs + 1]: offsets of each sequence's new tokens
    seq_lens: torch.Tensor  # int32 [num_seqs]: KV length of each sequence incl. new tokens
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]: cache blocks, -1 padded
    sample_indices: torch.Tensor  # int64 [num_samples]: token rows whose logits are sampled
    num_tokens: int  # real (unpadded) token count
    num_seqs: int
    max_seqlen_q: int  # most new tokens of one sequence (1 for a pure decode step)
    max_seq_len: int  # longest KV length in the batch

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token."""
        return self.max_seqlen_q == 1


class KVCache:
    """The paged KV cache: one K and one V tensor per layer, carved from a single allocation."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.storage = torch.zeros(shape, dtype=dtype, device=device)
        # Views made once: attention asks for its layer's on every call (~10 us to index).
        self._layers = [(self.storage[0, i], self.storage[1, i]) for i in range(num_layers)]

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(k_cache, v_cache)` of a layer, each `[num_blocks, block_size, kv_heads, head_dim]`."""
        return self._layers[layer_id]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


@dataclass
class ForwardContext:
    batch: ForwardBatch
    kv_cache: KVCache
    # The attention backend chosen at start-up, and its metadata for this batch (built once
    # per step, or once per decode graph bucket, whose replays all reuse it): layers read
    # both here and never build their own.
    attention: Any
    attention_metadata: Any = None


_current: ContextVar[ForwardContext | None] = ContextVar("bcg_forward_context", default=None)


@contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[None]:
    token = _current.set(context)
    try:
        yield
    finally:
        _current.reset(token)


def get_forward_context() -> ForwardContext:
    context = _current.get()
    if context is None:
        raise RuntimeError(
            "a stateful op ran outside a forward context: run the model through ModelRunner, "
            "or wrap the call in bcg.forward.set_forward_context(...)"
        )
    return context
