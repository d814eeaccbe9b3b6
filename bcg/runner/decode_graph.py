"""Decode graphs: batch-size buckets, attention reading the static buffers, so it may be
captured inside the graph ("full"); padded rows have sequence length 0 and cache slot -1.

The decode registry makes every field attention and the Mamba mixer read static, and its
padded tail harmless: positions and token ids zeroed, cache slots -1 (no KV written),
sequence lengths 0 (no KV read), block-table rows zeroed, and for a model with recurrent
state its state slots -1 (no state read or written).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from bcg.config import EngineConfig, parse_sizes
from bcg.forward import ForwardBatch, ForwardContext
from bcg.graph import GraphBufferRegistry, GraphSlot, PaddingPolicy
from bcg.runner.batch import build_batch
from bcg.runner.buckets import DECODE_BATCH_SIZES, ladder
from bcg.runner.graph_runner import CapturedStack, GraphRunner, StackSpec, graph_mode
from bcg.utils import cdiv

ZERO, SENTINEL = PaddingPolicy.ZERO, PaddingPolicy.FILL_SENTINEL


def build_decode_registry(device: torch.device, max_bs: int, max_blocks_per_seq: int,
                          stateful: bool = False) -> GraphBufferRegistry:
    """Batch-axis buffers for graphs of up to `max_bs` sequences of one new token each
    (`stateful`: and their state slots)."""
    registry = GraphBufferRegistry(device, max_bs=max_bs, max_num_tokens=max_bs)
    per_row = lambda bs, _: bs
    rows = [("input_ids", torch.int64, ZERO, None), ("positions", torch.int64, ZERO, None),
            ("slot_mapping", torch.int64, SENTINEL, -1), ("seq_lens", torch.int32, SENTINEL, 0)]
    if stateful:
        rows.append(("state_slots", torch.int32, SENTINEL, -1))
    for name, dtype, policy, pad in rows:
        registry.register_slot(GraphSlot(name, per_row, dtype, "bs", padding_policy=policy,
                                         pad_value=pad))
    registry.register_slot(GraphSlot("block_tables", lambda bs, _: (bs, max_blocks_per_seq),
                                     torch.int32, "bs", padding_policy=ZERO))
    # One new token per row: the offsets are always 0..bs, written once at allocation.
    registry.register_slot(
        GraphSlot("cu_seqlens_q", lambda bs, _: bs + 1, torch.int32, "bs",
                  padding_policy=PaddingPolicy.KEEP_PAD, copy_from_batch=False,
                  slice_fn=lambda buffer, start, stop: buffer[start : stop + 1]),
        bind=torch.arange(max_bs + 1, dtype=torch.int32, device=device),
    )
    return registry


class DecodeGraphRunner(GraphRunner):
    kind = "decode"

    def __init__(self, spec: StackSpec, mode: str, buckets: list[int], max_blocks_per_seq: int,
                 max_seq_len: int, pool: Any = None) -> None:
        super().__init__(spec, mode, buckets, pool)
        self.max_blocks_per_seq, self.max_seq_len = max_blocks_per_seq, max_seq_len
        self.registry = build_decode_registry(self.device, self.max_size, max_blocks_per_seq,
                                              spec.stateful)
        # No sequences: filling the buffers from it leaves every row as padding.
        self._empty = build_batch([], [], spec.block_size, self.device, stateful=spec.stateful)

    @classmethod
    def from_config(cls, spec: StackSpec, config: EngineConfig, max_model_len: int,
                    pool: Any = None) -> DecodeGraphRunner | None:
        """The runner `config` asks for (not captured yet, into `pool` if given), or None for
        eager decode."""
        mode = graph_mode(config.decode_graph, config.debug_cuda_graph)
        if mode == "none":
            return None
        buckets = ladder(parse_sizes(config.decode_graph_bs), DECODE_BATCH_SIZES,
                         config.max_num_seqs)
        return cls(spec, mode, buckets, max_blocks_per_seq=cdiv(max_model_len, spec.block_size),
                   max_seq_len=max_model_len, pool=pool)

    def size_of(self, batch: ForwardBatch) -> int | None:
        fits = batch.is_decode and batch.block_tables.shape[1] <= self.max_blocks_per_seq
        return batch.num_seqs if fits else None

    def fill(self, batch: ForwardBatch, bucket: int) -> None:
        self.registry.fill_from(batch, raw_bs=batch.num_seqs, padded_bs=bucket,
                                raw_num_tokens=batch.num_tokens, padded_num_tokens=bucket)

    def replay_context(self, batch: ForwardBatch, captured: CapturedStack) -> ForwardContext:
        return captured.context

    def capture_inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        self.registry.fill_from(self._empty, raw_bs=0, padded_bs=size, raw_num_tokens=0,
                                padded_num_tokens=size)
        static = self.registry.extract_buffer(padded_bs=size, padded_num_tokens=size,
                                              template=self._empty)
        static = dataclasses.replace(static, num_tokens=size, num_seqs=size,
                                     max_seq_len=self.max_seq_len)
        return static.input_ids, static.positions, self.make_context(static)
