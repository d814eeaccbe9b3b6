"""The base of the graph runners: the model's transformer stack captured once per bucket
(largest first, one memory pool), replayed per step.

A runner owns static input buffers (a `GraphBufferRegistry`), one captured graph per bucket
and the bucket's output tensor. `run(batch)` copies the live batch into the buffers, sets
the forward context and replays the smallest bucket that fits; the caller runs the head on
the live rows. The kinds (`decode_graph.py`, `prefill_graph.py`) differ in their buckets,
their buffers and what attention reads. Modes: "full" (one CUDA graph, decode only),
"breakable" (graph segments split at attention), "piecewise" (the same split over a
`torch.compile`d stack) and "debug" (a breakable graph whose single break runs the whole
stack eagerly: every op eager, through the same buffers, padding and replay path).
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from bcg.distributed.parallel_state import tensor_parallel
from bcg.forward import ForwardBatch, ForwardContext, set_forward_context
from bcg.graph import (
    BreakableCUDAGraph,
    BreakableCUDAGraphCapture,
    BridgeBuffers,
    CaptureNeedsWarmUp,
    abandon_capture,
    eager_on_graph,
    enable_breakable_cuda_graph,
    use_bridge_buffers,
)

logger = logging.getLogger(__name__)

Stack = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MakeContext = Callable[[ForwardBatch], ForwardContext]


@dataclass(frozen=True)
class StackSpec:
    """What a runner captures: the stack, how to build its forward context, its output."""

    stack: Stack
    make_context: MakeContext
    device: torch.device
    hidden_size: int
    dtype: torch.dtype
    block_size: int  # of the KV cache
    stateful: bool  # the model keeps recurrent state: batches carry state slots


def graph_mode(requested: str, debug: bool) -> str:
    """The mode a runner kind captures in: debug mode replaces every mode but "none"."""
    return "debug" if debug and requested != "none" else requested


@dataclass
class CapturedStack:
    graph: Any  # torch.cuda.CUDAGraph or BreakableCUDAGraph
    output: torch.Tensor  # the stack's hidden states, [bucket, hidden]
    context: ForwardContext  # what attention read at capture (and reads at replay, decode)


def settled_reserved_bytes(device: torch.device) -> int:
    """Memory the allocator reserves once the device is idle and freed blocks are back."""
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)


_frozen_depth = 0
_thaw_on_exit = False


@contextmanager
def frozen_gc() -> Iterator[None]:
    """Every object alive now is skipped by garbage collection until the outermost block
    ends: a collection during capture would otherwise scan hundreds of thousands of
    objects (a model's libraries loaded) at a random moment, and start-up's own
    collections, which only need the garbage its steps made, scan only that. Objects a
    host application froze itself stay frozen."""
    global _frozen_depth, _thaw_on_exit
    if _frozen_depth == 0:
        _thaw_on_exit = gc.get_freeze_count() == 0
        gc.freeze()
    _frozen_depth += 1
    try:
        yield
    finally:
        _frozen_depth -= 1
        if _frozen_depth == 0 and _thaw_on_exit:
            gc.unfreeze()


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
        self.stream = torch.cuda.Stream(self.device)  # one capture stream for every bucket
        self.bridges = BridgeBuffers()  # what crosses a break, shared by every layer
        self.warmed_sizes: set[int] = set()  # sizes whose warm-up ran
        # Tensor-parallel ranks capture the same buckets in the same order, and meet at every
        # graph break, so no rank's capture runs ahead of the collectives of another's.
        tp = tensor_parallel()
        self.barrier_fn = tp.barrier if tp.size > 1 else None
        # Which kernels a process has compiled differs by rank (rank 0 may have run an engine
        # before): a capture that warms up and retries on one rank alone would run collectives
        # the others do not. So under tensor parallelism every size is warmed up, as a
        # piecewise stack's must be (it compiles per size).
        self.warm_up_every_size = mode == "piecewise" or tp.size > 1
        self.capture_seconds = 0.0  # warm-ups included
        self.warm_up_seconds = 0.0
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

    def release(self) -> None:
        """Reset every captured graph now, not whenever the garbage collector gets to it: a
        graph that captured collectives must be gone before their process group is."""
        torch.cuda.synchronize(self.device)  # no replay still running
        for captured in self.graphs.values():
            captured.graph.reset()
        self.graphs.clear()

    def capture_all(self) -> None:
        """Capture every bucket, largest first so smaller ones reuse the pool's blocks.
        Only the largest is warmed up beforehand (lazily made workspaces then land outside
        the pool); another is warmed up only if its capture meets a kernel variant not yet
        compiled, which a capture cannot load. Under `warm_up_every_size` each size is
        warmed up beforehand. Garbage is collected and the device synchronised
        once per runner, not per bucket; the garbage collector is frozen meanwhile."""
        reserved = settled_reserved_bytes(self.device)
        sizes = sorted(self.buckets, reverse=True)
        self.warm_up_seconds = 0.0
        start = time.perf_counter()
        with frozen_gc():
            inputs = {size: self.capture_inputs(size) for size in sizes}
            for size in sizes if self.warm_up_every_size else sizes[:1]:
                self._warm_up(size, inputs[size])
            desc = f"capturing {self.kind} graphs ({self.mode})"
            for size in tqdm(sizes, desc=desc, unit="graph", leave=False):
                self.graphs[size] = self._capture_warmed(size, inputs[size])
            torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        self.pool_bytes = settled_reserved_bytes(self.device) - reserved
        warm_up = self.warm_up_seconds
        logger.info("%s graphs (%s): %d buckets %s in %.2f s (warm-up of %d in %.2f s, capture "
                    "%.2f s), graph pool %.3f GiB", self.kind, self.mode, len(sizes),
                    self.buckets, self.capture_seconds, len(self.warmed_sizes), warm_up,
                    self.capture_seconds - warm_up, self.pool_bytes / 2**30)

    def measure_pool_bytes(self) -> int:
        """Pool memory the graphs will take, from a throw-away capture of the largest bucket
        (smaller buckets reuse its blocks), so the KV cache can be sized around it."""
        reserved = settled_reserved_bytes(self.device)
        with frozen_gc():
            inputs = self.capture_inputs(self.max_size)
            self._warm_up(self.max_size, inputs)
            captured = self._capture_warmed(self.max_size, inputs)
        # Settled first: the warm-up's freed activations are cache, not pool.
        used = settled_reserved_bytes(self.device) - reserved
        del captured
        settled_reserved_bytes(self.device)
        self.pool = torch.cuda.graph_pool_handle()  # the measured pool is gone
        return used

    def _capture_warmed(self, size: int, inputs: tuple) -> CapturedStack:
        """Capture `size`; if the capture meets a kernel it cannot load, warm up and retry."""
        try:
            return self._capture(*inputs)
        except CaptureNeedsWarmUp:
            if size in self.warmed_sizes:
                raise
        self._warm_up(size, inputs)
        return self._capture(*inputs)

    @torch.inference_mode()
    def _warm_up(self, size: int, inputs: tuple) -> None:
        """Run the stack once on `size`'s capture inputs, on the capture stream: its kernel
        variants are compiled (Triton specialises on sizes) and lazily made workspaces
        allocated (cuBLAS keeps one per stream) outside the graph pool. The capture that follows
        runs on the same stream, so nothing waits for the device here."""
        if size in self.warmed_sizes:  # by measure_pool_bytes
            return
        start = time.perf_counter()
        input_ids, positions, context = inputs
        with (torch.cuda.stream(self.stream), use_bridge_buffers(self.bridges),
              set_forward_context(context), enable_breakable_cuda_graph(self.mode != "full")):
            self.stack(input_ids, positions)
        self.warmed_sizes.add(size)
        self.warm_up_seconds += time.perf_counter() - start

    @torch.inference_mode()
    def _capture(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 context: ForwardContext) -> CapturedStack:
        with (set_forward_context(context), enable_breakable_cuda_graph(self.mode != "full"),
              use_bridge_buffers(self.bridges)):
            if self.mode == "full":
                # Not torch.cuda.graph: it synchronises and empties the cache every capture.
                graph = torch.cuda.CUDAGraph()
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.stream):
                    graph.capture_begin(pool=self.pool)
                    try:
                        output = self.stack(input_ids, positions)
                    except BaseException:
                        abandon_capture(graph)
                        raise
                    graph.capture_end()
                return CapturedStack(graph, output, context)
            graph = BreakableCUDAGraph()
            # Debug mode checks that no break leaks memory a replay would then read freed.
            with BreakableCUDAGraphCapture(graph, pool=self.pool, stream=self.stream,
                                           barrier_fn=self.barrier_fn,
                                           check_leaks=self.mode == "debug"):
                if self.mode == "debug":
                    output = torch.empty(input_ids.shape[0], self.hidden_size, dtype=self.dtype,
                                         device=self.device)
                    run_stack_eagerly(self.stack, input_ids, positions, output)
                else:
                    output = self.stack(input_ids, positions)
        return CapturedStack(graph, output, context)

    # What differs between decode and prefill runners:
    def size_of(self, batch: ForwardBatch) -> int | None:
        raise NotImplementedError

    def fill(self, batch: ForwardBatch, bucket: int) -> None:
        raise NotImplementedError

    def replay_context(self, batch: ForwardBatch, captured: CapturedStack) -> ForwardContext:
        raise NotImplementedError

    def capture_inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        raise NotImplementedError
