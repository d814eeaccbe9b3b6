"""Breakable prefill graphs: token-count buckets capturing only token-wise ops; attention
is an eager break reading the live batch, so one graph serves any mix of requests that fits
(several prompts, chunks and decodes together). The static buffers are just the token ids
and positions."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from bcg.config import EngineConfig, parse_sizes
from bcg.forward import ForwardBatch, ForwardContext
from bcg.graph import GraphBufferRegistry, GraphSlot, PaddingPolicy
from bcg.layers.step_op import prepare_for_compile
from bcg.runner.batch import SyntheticSequence, build_batch
from bcg.runner.buckets import PREFILL_TOKENS, ladder
from bcg.runner.graph_runner import CapturedStack, GraphRunner, StackSpec, graph_mode
from bcg.utils import cdiv


def build_prefill_registry(device: torch.device, max_num_tokens: int) -> GraphBufferRegistry:
    """Token-axis buffers for breakable prefill graphs of up to `max_num_tokens` tokens."""
    registry = GraphBufferRegistry(device, max_bs=1, max_num_tokens=max_num_tokens)
    for name in ("input_ids", "positions"):
        registry.register_slot(GraphSlot(name, lambda _, tokens: tokens, torch.int64, "tokens",
                                         padding_policy=PaddingPolicy.ZERO))
    return registry


class PrefillGraphRunner(GraphRunner):
    kind = "prefill"

    def __init__(self, spec: StackSpec, mode: str, buckets: list[int], pool: Any = None) -> None:
        super().__init__(spec, mode, buckets, pool)
        self.block_size, self.stateful = spec.block_size, spec.stateful
        self.registry = build_prefill_registry(self.device, self.max_size)

    @classmethod
    def from_config(cls, spec: StackSpec, config: EngineConfig) -> PrefillGraphRunner | None:
        """The runner `config` asks for (not captured yet), or None for eager prefill."""
        mode = graph_mode(config.prefill_graph, config.debug_cuda_graph)
        if mode == "none":
            return None
        buckets = ladder(parse_sizes(config.prefill_graph_tokens), PREFILL_TOKENS,
                         config.max_num_batched_tokens)
        if mode == "piecewise":
            prepare_for_compile()
            spec = dataclasses.replace(spec, stack=torch.compile(spec.stack, dynamic=True))
        return cls(spec, mode, buckets)

    def size_of(self, batch: ForwardBatch) -> int | None:
        return batch.num_tokens

    def fill(self, batch: ForwardBatch, bucket: int) -> None:
        self.registry.fill_from(batch, raw_bs=0, padded_bs=0, raw_num_tokens=batch.num_tokens,
                                padded_num_tokens=bucket)

    def replay_context(self, batch: ForwardBatch, captured: CapturedStack) -> ForwardContext:
        return self.make_context(batch)

    def capture_inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        # One sequence of `size` new tokens whose keys and values are never stored: attention
        # runs at capture on block 0 and its output is thrown away.
        seq = SyntheticSequence([0] * size, [0] * cdiv(size, self.block_size))
        template = build_batch([seq], [size], self.block_size, self.device, store_kv=False,
                               stateful=self.stateful)
        static = self.registry.extract_buffer(padded_bs=1, padded_num_tokens=size,
                                              template=template)
        # A segment serves every batch that fits, decodes included, and is captured before
        # the cache exists: the attention break stores the live batch's keys and values,
        # never rotary inside the segment.
        context = dataclasses.replace(self.make_context(static), rotary_may_store_kv=False)
        return static.input_ids, static.positions, context
