"""The static input buffers of the graph runners, declared once over `ForwardBatch` fields.

Decode graphs run attention inside the graph, so every field attention reads is static and
its padded tail is made harmless: positions and token ids zeroed, cache slots -1 (no KV
written), sequence lengths 0 (no KV read), block-table rows zeroed. Prefill graphs capture
only token-wise ops (attention is an eager break reading the live batch), so they need just
the token ids and positions.
"""

from __future__ import annotations

import torch

from bcg.graph import GraphBufferRegistry, GraphSlot, PaddingPolicy

ZERO = PaddingPolicy.ZERO
SENTINEL = PaddingPolicy.FILL_SENTINEL


def build_decode_registry(
    device: torch.device, max_bs: int, max_blocks_per_seq: int
) -> GraphBufferRegistry:
    """Batch-axis buffers for graphs of up to `max_bs` sequences of one new token each."""
    registry = GraphBufferRegistry(device, max_bs=max_bs, max_num_tokens=max_bs)
    for name, dtype in (("input_ids", torch.int64), ("positions", torch.int64)):
        registry.register_slot(GraphSlot(name, _per_row, dtype, axis="bs", padding_policy=ZERO))
    registry.register_slot(
        GraphSlot(
            "slot_mapping", _per_row, torch.int64, "bs", padding_policy=SENTINEL, pad_value=-1
        )
    )
    registry.register_slot(
        GraphSlot("seq_lens", _per_row, torch.int32, "bs", padding_policy=SENTINEL, pad_value=0)
    )
    registry.register_slot(
        GraphSlot(
            "block_tables",
            lambda bs, _: (bs, max_blocks_per_seq),
            torch.int32,
            "bs",
            padding_policy=ZERO,
        )
    )
    # One new token per row: the offsets are always 0..bs, written once at allocation.
    registry.register_slot(
        GraphSlot(
            "cu_seqlens_q",
            lambda bs, _: bs + 1,
            torch.int32,
            "bs",
            padding_policy=PaddingPolicy.KEEP_PAD,
            copy_from_batch=False,
            slice_fn=lambda buffer, start, stop: buffer[start : stop + 1],
        ),
        bind=torch.arange(max_bs + 1, dtype=torch.int32, device=device),
    )
    return registry


def build_prefill_registry(device: torch.device, max_num_tokens: int) -> GraphBufferRegistry:
    """Token-axis buffers for breakable prefill graphs of up to `max_num_tokens` tokens."""
    registry = GraphBufferRegistry(device, max_bs=1, max_num_tokens=max_num_tokens)
    for name in ("input_ids", "positions"):
        registry.register_slot(
            GraphSlot(name, lambda _, tokens: tokens, torch.int64, "tokens", padding_policy=ZERO)
        )
    return registry


def _per_row(max_bs: int, _max_num_tokens: int) -> int:
    return max_bs
