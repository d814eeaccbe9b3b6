"""`BreakableCUDAGraph`: CUDA graph segments with eager breaks between them."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import torch

from bcg.graph.context import _replay_token, next_replay_token
from bcg.graph.copy_output import copy_output
from bcg.graph.driver_launch import (
    current_raw_stream,
    driver_launcher,
    generator_offset,
    launches_through_driver,
    plain_cuda_graph,
    thread_has_context,
)


class GraphReplayError(RuntimeError):
    """A segment or break failed during `BreakableCUDAGraph.replay()`."""


class BreakableCUDAGraph:
    """An ordered list of real CUDA graph segments and the eager breaks between them.

    Fill it with `BreakableCUDAGraphCapture`; `replay()` then runs segment 0, break 0,
    segment 1, ... on the current stream. Empty segments are dropped at capture, so they
    cost nothing at replay. Segments are launched through the CUDA driver where it can
    (see `driver_launch`), except those that draw random numbers, which the first replay
    finds out by launching every segment through torch.
    """

    def __init__(self) -> None:
        self._segments: list[Any] = []
        # Empty segments are never replayed but stay alive until reset(): releasing one
        # early would release its hold on the shared memory pool mid-capture.
        self._empty_segments: list[Any] = []
        self._steps: list[Callable[[], None]] = []  # torch's launches and the breaks
        self._labels: list[str] = []
        self._pool: Any = None
        self._num_breaks = 0
        self._captured = False
        self._device: int | None = None  # where the segments were captured
        self._driver_segments: dict[int, Any] = {}  # step index -> segment
        self._random_segments: set[int] | None = None  # step indices; None until replayed
        self._steps_by_stream: dict[int, list[Callable[[], None]]] = {}  # raw stream -> steps

    @property
    def num_segments(self) -> int:
        """Segments that hold work (empty ones are dropped)."""
        return len(self._segments)

    @property
    def num_breaks(self) -> int:
        return self._num_breaks

    @property
    def is_captured(self) -> bool:
        return self._captured

    def pool(self) -> Any:
        """The memory pool handle; pass it to another capture to share the pool."""
        return self._pool

    def replay(self) -> None:
        """Run every segment and break in capture order on the current stream."""
        if not self._captured:
            raise RuntimeError(
                "BreakableCUDAGraph.replay(): the graph has not been captured; capture it "
                "inside `with BreakableCUDAGraphCapture(graph): ...` first"
            )
        if self._device is not None and torch.cuda.current_device() != self._device:
            with torch.cuda.device(self._device):
                return self.replay()
        token = _replay_token.set(next_replay_token())
        try:
            if not self._driver_segments or not thread_has_context():
                self._run(self._steps)  # torch's launches make the thread's context current
            elif self._random_segments is None:
                random_segments: set[int] = set()
                self._run(self._learning_steps(random_segments))
                self._random_segments = random_segments
            else:
                self._run(self._replay_steps())
        finally:
            _replay_token.reset(token)

    def _run(self, steps: list[Callable[[], None]]) -> None:
        remaining = iter(steps)  # no per-step bookkeeping: a failure finds its step from it
        try:
            for step in remaining:
                step()
        except Exception as error:
            label = self._labels[len(steps) - operator.length_hint(remaining) - 1]
            raise GraphReplayError(
                f"replay failed in {label}: {type(error).__name__}: {error}"
            ) from error

    def _learning_steps(self, random_segments: set[int]) -> list[Callable[[], None]]:
        """The steps, each segment launched by torch while noting into `random_segments`
        whether its launch advanced the random generator."""
        steps = list(self._steps)
        for index in self._driver_segments:
            steps[index] = functools.partial(self._launch_noting_randomness, index,
                                             random_segments)
        return steps

    def _launch_noting_randomness(self, index: int, random_segments: set[int]) -> None:
        before = generator_offset(self._device)
        self._steps[index]()
        if generator_offset(self._device) != before:
            random_segments.add(index)

    def _replay_steps(self) -> list[Callable[[], None]]:
        """The steps, every segment that draws no random numbers launched through the
        driver on the current stream (bound once per stream)."""
        if not self._driver_segments:
            return self._steps
        stream = current_raw_stream(self._device)
        steps = self._steps_by_stream.get(stream)
        if steps is None:
            steps = list(self._steps)
            for index, segment in self._driver_segments.items():
                if index not in self._random_segments:
                    steps[index] = driver_launcher(segment, stream)
            self._steps_by_stream[stream] = steps
        return steps

    def reset(self) -> None:
        """Release every segment and break so the graph can be captured again."""
        for segment in self._segments + self._empty_segments:
            segment.reset()
        self.__init__()

    def _add_segment(self, segment: Any, empty: bool) -> None:
        if empty:
            self._empty_segments.append(segment)
            return
        self._segments.append(segment)
        if plain_cuda_graph(segment):
            self._device = torch.cuda.current_device()
        if launches_through_driver(segment):
            self._driver_segments[len(self._steps)] = segment
        self._steps.append(_launcher(segment))
        self._labels.append(f"segment {self._num_breaks}")

    def _add_break(self, fn: Callable, args: tuple, kwargs: dict, capture_result: Any) -> None:
        # The step closes over the argument objects and the capture-time result: strong
        # references, so their memory can never be handed to another capture in the pool.
        if capture_result is None:
            step = functools.partial(fn, *args, **kwargs)  # called without a Python frame
        else:

            def step() -> None:
                copy_output(capture_result, fn(*args, **kwargs))

        self._steps.append(step)
        self._labels.append(f"break {self._num_breaks} ({fn.__module__}.{fn.__qualname__})")
        self._num_breaks += 1

    def _begin_capture(self, pool: Any) -> None:
        if self._captured:
            raise RuntimeError(
                "BreakableCUDAGraphCapture: this graph is already captured; call "
                "graph.reset() before capturing it again, or use a new BreakableCUDAGraph"
            )
        self._pool = pool

    def _finish_capture(self) -> None:
        self._captured = True


def _launcher(segment: Any) -> Callable[[], None]:
    """`segment.replay`, minus torch's Python wrapper where the wrapper has nothing to do
    (no input-liveness tracker, which bcg never asks for): one frame less per segment."""
    if plain_cuda_graph(segment):
        return super(torch.cuda.CUDAGraph, segment).replay
    return segment.replay
