"""Graph runners: the model's transformer stack captured once per bucket, replayed per step.

A runner owns static input buffers (a `GraphBufferRegistry`), one captured graph per bucket
and the bucket's output tensor. `run(batch)` copies the live batch into the buffers, sets
the forward context and replays the smallest bucket that fits; the caller runs the head on
the live rows. Two kinds differ only in what they capture and what attention reads:

- decode (batch-size buckets): attention reads the static buffers, so it may be captured
  inside the graph ("full"); padded rows have sequence length 0 and cache slot -1.
- prefill (token-count buckets): only token-wise ops are captured; attention is an eager
  break reading the live batch, so one graph serves any mix of requests that fits.

Modes: "full" (one CUDA graph, decode only), "breakable" (graph segments split at
attention), "piecewise" (the same split over a `torch.compile`d stack) and "debug" (a
breakable graph whose single break runs the whole stack eagerly: every op runs eagerly
through the same buffers, padding and replay path).
"""

from __future__ import annotations

import bisect
import dataclasses
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from bcg.graph import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    eager_on_graph,
    enable_breakable_cuda_graph,
)
from bcg.runner.context import ForwardContext, set_forward_context
from bcg.runner.forward_batch import ForwardBatch
from bcg.runner.graph_registry import build_decode_registry, build_prefill_registry

logger = logging.getLogger(__name__)

Stack = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MakeContext = Callable[[ForwardBatch], ForwardContext]
WARMUPS_PER_SIZE = 2


@dataclass(frozen=True)
class StackSpec:
    """What a runner captures: the stack, how to build its forward context, its output."""

    stack: Stack
    make_context: MakeContext
    device: torch.device
    hidden_size: int
    dtype: torch.dtype


@dataclass
class CapturedStack:
    graph: Any  # torch.cuda.CUDAGraph or BreakableCUDAGraph
    output: torch.Tensor  # the stack's hidden states, [bucket, hidden]
    context: ForwardContext  # what attention read at capture (and reads at replay, decode)


@eager_on_graph
def run_stack_eagerly(stack: Stack, input_ids, positions, output: torch.Tensor) -> None:
    """Debug mode's single break: the whole stack, eagerly, into the captured output."""
    output.copy_(stack(input_ids, positions))


class GraphRunner:
    """Captures `stack` per bucket (largest first, one memory pool) and replays it."""

    kind = "graph"

    def __init__(self, spec: StackSpec, mode: str, buckets: list[int], pool: Any = None) -> None:
        self.stack, self.make_context = spec.stack, spec.make_context
        self.device, self.hidden_size, self.dtype = spec.device, spec.hidden_size, spec.dtype
        self.mode = mode
        self.buckets = sorted(set(buckets))
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.graphs: dict[int, CapturedStack] = {}
        self.capture_seconds = 0.0
        self.pool_bytes = 0

    @property
    def max_size(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, batch: ForwardBatch) -> int | None:
        """The smallest captured bucket that fits `batch`, or None to run it eagerly."""
        size = self.size_of(batch)
        if size is None or size > self.max_size:
            return None
        return self.buckets[bisect.bisect_left(self.buckets, size)]

    def run(self, batch: ForwardBatch, bucket: int) -> torch.Tensor:
        """Replay `bucket` on `batch`: `[bucket, hidden]`, rows past the batch being padding."""
        captured = self.graphs[bucket]
        self.fill(batch, bucket)
        context = self.replay_context(batch, captured)
        with set_forward_context(context):
            captured.graph.replay()
        return captured.output

    def capture_all(self) -> None:
        """Capture every bucket, largest first so smaller ones reuse the pool's blocks."""
        reserved = self._settled_reserved_bytes()
        start = time.perf_counter()
        sizes = sorted(self.buckets, reverse=True)
        for size in tqdm(
            sizes, desc=f"capturing {self.kind} graphs ({self.mode})", unit="graph", leave=False
        ):
            self.graphs[size] = self.capture_one(size)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        self.pool_bytes = self._settled_reserved_bytes() - reserved
        logger.info(
            "%s graphs (%s): %d buckets %s captured in %.2f s, graph pool %.3f GiB",
            self.kind,
            self.mode,
            len(sizes),
            self.buckets,
            self.capture_seconds,
            self.pool_bytes / 2**30,
        )

    def measure_pool_bytes(self) -> int:
        """Pool memory the graphs will take, from a throw-away capture of the largest bucket
        (smaller buckets reuse its blocks), so the KV cache can be sized around it."""
        reserved = self._settled_reserved_bytes()
        captured = self.capture_one(self.max_size)
        # Settled first: the warm-ups' freed activations are cache, not pool.
        used = self._settled_reserved_bytes() - reserved
        del captured
        self._settled_reserved_bytes()
        self.pool = torch.cuda.graph_pool_handle()  # the measured pool is gone
        return used

    def _settled_reserved_bytes(self) -> int:
        """Memory the allocator reserves once the device is idle and freed blocks are back."""
        torch.cuda.synchronize(self.device)
        gc.collect()
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(self.device)

    @torch.inference_mode()
    def capture_one(self, size: int) -> CapturedStack:
        input_ids, positions, context = self.capture_inputs(size)
        with set_forward_context(context), enable_breakable_cuda_graph(self.mode != "full"):
            for _ in range(WARMUPS_PER_SIZE):
                self.stack(input_ids, positions)
            torch.cuda.synchronize(self.device)
            gc.collect()
            graph, output = self._capture(input_ids, positions)
        return CapturedStack(graph, output, context)

    def _capture(self, input_ids: torch.Tensor, positions: torch.Tensor):
        if self.mode == "full":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                output = self.stack(input_ids, positions)
            return graph, output
        graph = BreakableCUDAGraph()
        with BreakableCUDAGraphCapture(graph, pool=self.pool):
            if self.mode == "debug":
                output = torch.empty(
                    input_ids.shape[0], self.hidden_size, dtype=self.dtype, device=self.device
                )
                run_stack_eagerly(self.stack, input_ids, positions, output)
            else:
                output = self.stack(input_ids, positions)
        return graph, output

    # What differs between decode and prefill runners:
    def size_of(self, batch: ForwardBatch) -> int | None:
        raise NotImplementedError

    def fill(self, batch: ForwardBatch, bucket: int) -> None:
        raise NotImplementedError

    def replay_context(self, batch: ForwardBatch, captured: CapturedStack) -> ForwardContext:
        raise NotImplementedError

    def capture_inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        raise NotImplementedError


def empty_batch(device: torch.device, max_blocks_per_seq: int) -> ForwardBatch:
    """A batch of no sequences: filling buffers from it leaves every row as padding."""
    ints = lambda dtype, *shape: torch.zeros(shape, dtype=dtype, device=device)
    return ForwardBatch(
        input_ids=ints(torch.int64, 0),
        positions=ints(torch.int64, 0),
        slot_mapping=ints(torch.int64, 0),
        cu_seqlens_q=ints(torch.int32, 1),
        seq_lens=ints(torch.int32, 0),
        block_tables=ints(torch.int32, 0, max_blocks_per_seq),
        sample_indices=ints(torch.int64, 0),
        num_tokens=0,
        num_seqs=0,
        max_seqlen_q=1,
        max_seq_len=0,
    )


class DecodeGraphRunner(GraphRunner):
    """Batch-size buckets; attention reads the static buffers (inside the graph when "full")."""

    kind = "decode"

    def __init__(
        self,
        spec: StackSpec,
        mode: str,
        buckets: list[int],
        max_blocks_per_seq: int,
        max_seq_len: int,
        pool: Any = None,
    ) -> None:
        super().__init__(spec, mode, buckets, pool)
        self.max_blocks_per_seq, self.max_seq_len = max_blocks_per_seq, max_seq_len
        self.registry = build_decode_registry(self.device, self.max_size, max_blocks_per_seq)
        self._empty = empty_batch(self.device, max_blocks_per_seq)

    def size_of(self, batch: ForwardBatch) -> int | None:
        fits = batch.is_decode and batch.block_tables.shape[1] <= self.max_blocks_per_seq
        return batch.num_seqs if fits else None

    def fill(self, batch: ForwardBatch, bucket: int) -> None:
        self.registry.fill_from(
            batch,
            raw_bs=batch.num_seqs,
            padded_bs=bucket,
            raw_num_tokens=batch.num_tokens,
            padded_num_tokens=bucket,
        )

    def replay_context(self, batch: ForwardBatch, captured: CapturedStack) -> ForwardContext:
        return captured.context

    def capture_inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        self.registry.fill_from(
            self._empty, raw_bs=0, padded_bs=size, raw_num_tokens=0, padded_num_tokens=size
        )
        static = self.registry.extract_buffer(
            padded_bs=size, padded_num_tokens=size, template=self._empty
        )
        static = dataclasses.replace(
            static, num_tokens=size, num_seqs=size, max_seq_len=self.max_seq_len
        )
        return static.input_ids, static.positions, self.make_context(static)


class PrefillGraphRunner(GraphRunner):
    """Token-count buckets; attention is a break reading the live batch, so any mix fits."""

    kind = "prefill"

    def __init__(
        self, spec: StackSpec, mode: str, buckets: list[int], block_size: int, pool: Any = None
    ) -> None:
        super().__init__(spec, mode, buckets, pool)
        self.block_size = block_size
        self.registry = build_prefill_registry(self.device, self.max_size)

    def size_of(self, batch: ForwardBatch) -> int | None:
        return batch.num_tokens

    def fill(self, batch: ForwardBatch, bucket: int) -> None:
        self.registry.fill_from(
            batch, raw_bs=0, padded_bs=0, raw_num_tokens=batch.num_tokens, padded_num_tokens=bucket
        )

    def replay_context(self, batch: ForwardBatch, captured: CapturedStack) -> ForwardContext:
        return self.make_context(batch)

    def capture_inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        static = self.registry.extract_buffer(
            padded_bs=1, padded_num_tokens=size, template=self._capture_batch(size)
        )
        return static.input_ids, static.positions, self.make_context(static)

    def _capture_batch(self, size: int) -> ForwardBatch:
        """One sequence of `size` new tokens whose keys and values are never stored (slot -1):
        attention runs at capture on block 0 and its output is thrown away."""
        ints = lambda values, dtype: torch.tensor(values, dtype=dtype, device=self.device)
        num_blocks = -(-size // self.block_size)
        return ForwardBatch(
            input_ids=ints([0] * size, torch.int64),
            positions=ints(range(size), torch.int64),
            slot_mapping=ints([-1] * size, torch.int64),
            cu_seqlens_q=ints([0, size], torch.int32),
            seq_lens=ints([size], torch.int32),
            block_tables=ints([[0] * num_blocks], torch.int32),
            sample_indices=ints([size - 1], torch.int64),
            num_tokens=size,
            num_seqs=1,
            max_seqlen_q=size,
            max_seq_len=size,
        )
