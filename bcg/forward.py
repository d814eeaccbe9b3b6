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
    # int32 [num_seqs]: each sequence's recurrent state slot (hybrids; None for models
    # without state); < 0 has no slot: its state starts at zero and is not kept (start-up
    # stand-ins, graph padding).
    state_slots: torch.Tensor | None
    num_tokens: int  # real (unpadded) token count
    num_seqs: int
    max_seqlen_q: int  # most new tokens of one sequence (1 for a pure decode step)
    max_seq_len: int  # longest KV length in the batch
    # Leading sequences that add one token each (the scheduler puts decodes first): a mixed
    # step's attention runs them through the decode kernel. All of them in a decode step.
    num_decode_seqs: int = 0

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


class MambaStateCache:
    """Recurrent state of every running sequence of a hybrid: per Mamba layer one conv state
    (the last `conv_kernel - 1` inputs of the causal conv) and one SSM state per slot, a
    sequence keeping its slot from admission to finish. The SSM state is kept in fp32 (as
    transformers' `mamba_ssm_cache_dtype` default): decode adds to it every token."""

    def __init__(self, num_layers: int, num_slots: int, conv_kernel: int, conv_dim: int,
                 num_heads: int, head_dim: int, state_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_slots = num_slots
        # Token-major conv state: one tap's channels contiguous, as the kernels load them.
        self.conv = torch.zeros(num_layers, num_slots, conv_kernel - 1, conv_dim, dtype=dtype,
                                device=device)
        self.ssm = torch.zeros(num_layers, num_slots, num_heads, head_dim, state_size,
                               dtype=torch.float32, device=device)
        self._layers = [(self.conv[i], self.ssm[i]) for i in range(num_layers)]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(conv_state [slots, K - 1, conv_dim], ssm_state [slots, heads, head_dim, state])`
        of the `index`-th Mamba layer."""
        return self._layers[index]

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes

    @staticmethod
    def bytes_per_slot(num_layers: int, conv_kernel: int, conv_dim: int, num_heads: int,
                       head_dim: int, state_size: int, dtype: torch.dtype) -> int:
        conv = (conv_kernel - 1) * conv_dim * dtype.itemsize
        ssm = num_heads * head_dim * state_size * torch.float32.itemsize
        return num_layers * (conv + ssm)

    def save(self, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of `slots`' states in every layer, for `restore`."""
        return self.conv[:, slots].clone(), self.ssm[:, slots].clone()

    def restore(self, slots: list[int], saved: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.conv[:, slots], self.ssm[:, slots] = saved


@dataclass
class ForwardContext:
    batch: ForwardBatch
    kv_cache: KVCache
    # The attention backend chosen at start-up, and its metadata for this batch (built once
    # per step, or once per decode graph bucket, whose replays all reuse it): layers read
    # both here and never build their own.
    attention: Any
    attention_metadata: Any = None
    # Hybrids: the recurrent state cache and the Mamba backend chosen at start-up; the
    # mixer finds each sequence's slot in `batch.state_slots` (a static buffer in decode
    # graphs, the live batch behind a prefill graph's break).
    state_cache: MambaStateCache | None = None
    mamba: Any = None
    # Whether the backend may hand a decode's key/value store to rotary (one launch less):
    # not while a prefill graph is captured, whose segments serve any later batch.
    rotary_may_store_kv: bool = True


# Where a step's new keys and values go, for a kernel that stores them beside its own work
# (rotary, in decode steps): (v, k_cache, v_cache, slot_mapping), as `store_kv` takes them.
KVStore = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

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
