"""`BreakableCUDAGraphCapture`: capture a region as segments split at eager breaks."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import torch

from bcg.graph.context import _current_stream
from bcg.graph.copy_output import tensors_in
from bcg.graph.graph import BreakableCUDAGraph

_EMPTY_GRAPH_WARNING = "The CUDA Graph is empty"
CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")  # cudaStreamCaptureMode


class CudaBackend:
    """The few CUDA calls a capture makes; tests substitute a fake to drive the protocol
    on a machine without a GPU."""

    recording_allocations = False

    def new_segment(self) -> torch.cuda.CUDAGraph:
        return torch.cuda.CUDAGraph()

    def graph_pool_handle(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream()

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream()

    def stream_context(self, stream: torch.cuda.Stream) -> Any:
        return torch.cuda.stream(stream)

    def reset_generators(self) -> None:
        """A capture that fails at its end leaves torch's CUDA generators marked as capturing,
        so every later random op in the process raises; a capture that ends cleanly unmarks
        them."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(torch.cuda.Stream()), warnings.catch_warnings():
            warnings.filterwarnings("ignore", _EMPTY_GRAPH_WARNING)
            graph.capture_begin()
            graph.capture_end()

    @property
    def stream_class(self) -> type:
        return torch.cuda.Stream

    def start_recording_allocations(self) -> None:
        """Record allocation stacks (for the leak report) from now on: refuse if someone
        else already records them (our settings would replace theirs). Once started it
        stays on for the process: stopping keeps the recorded stacks on live blocks, which
        the next capture could not tell from someone else's recording."""
        if self.recording_allocations:
            return
        snapshot = torch.cuda.memory._snapshot()
        if any(snapshot.get("device_traces", [])) or any(
                block.get("frames") for segment in snapshot["segments"]
                for block in segment["blocks"]):
            raise RuntimeError(
                "check_leaks records CUDA allocation history, which is already being recorded "
                "(torch.cuda.memory._record_memory_history): stop that recording first, or "
                "capture without check_leaks")
        # Python stacks of allocations only: C++ stacks would slow every later allocation.
        torch.cuda.memory._record_memory_history(context="alloc", stacks="python",
                                                 max_entries=100_000)
        self.recording_allocations = True

    def live_blocks(self) -> dict[int, tuple[int, list]]:
        """Allocated blocks: address -> (bytes, allocation stack frames)."""
        return {block["address"]: (block["size"], block.get("frames", []))
                for segment in torch.cuda.memory._snapshot()["segments"]
                for block in segment["blocks"] if block["state"] == "active_allocated"}


backend = CudaBackend()
_current_capture: ContextVar[BreakableCUDAGraphCapture | None] = ContextVar(
    "bcg_current_capture", default=None
)


def current_capture() -> BreakableCUDAGraphCapture | None:
    """The capture active in this thread/context, if any."""
    return _current_capture.get()


class _WaitStreamTracker:
    """While any capture is active, `Stream.wait_stream` also tells the capture of this
    context when a stream forks from its capture stream (`side.wait_stream(capture)`, as
    model code forks for overlapped work), so that stream is joined before each segment
    ends like one from `fork_stream`. Installed on the stream class for the duration of
    the captures (counted, so concurrent captures in other threads share it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._installed: tuple[type, Callable] | None = None

    def install(self, stream_class: type) -> None:
        with self._lock:
            self._users += 1
            if self._installed is None:
                original = stream_class.wait_stream

                def wait_stream(stream, other) -> None:
                    original(stream, other)
                    capture = _current_capture.get()
                    if capture is not None and other == capture.stream and stream != other:
                        capture.track_fork(stream)

                stream_class.wait_stream = wait_stream
                self._installed = (stream_class, original)

    def uninstall(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._installed is not None:
                stream_class, original = self._installed
                stream_class.wait_stream = original
                self._installed = None


_wait_stream_tracker = _WaitStreamTracker()


class BreakableCUDAGraphCapture:
    """Context manager that captures the enclosed code into a `BreakableCUDAGraph`.

    Every call to an `eager_on_graph` function inside it ends the current segment, runs
    `barrier_fn` (e.g. to re-align tensor-parallel ranks), runs the function eagerly on
    the capture stream, records it as a replay step and begins the next segment. All
    segments allocate from one memory pool: `pool` (another graph's `pool()`) or a new one.
    No garbage collection, cache emptying or device synchronisation happens here: do
    those once per captured size, before entering.
    """

    def __init__(
        self,
        graph: BreakableCUDAGraph,
        pool: Any = None,
        stream: torch.cuda.Stream | None = None,
        capture_error_mode: str = "global",
        barrier_fn: Callable[[], None] | None = None,
        check_leaks: bool = False,
    ) -> None:
        if not isinstance(graph, BreakableCUDAGraph):
            raise TypeError(
                f"BreakableCUDAGraphCapture needs a BreakableCUDAGraph, got "
                f"{type(graph).__name__}; create one with BreakableCUDAGraph()"
            )
        if barrier_fn is not None and not callable(barrier_fn):
            raise TypeError(f"BreakableCUDAGraphCapture: barrier_fn must be callable or None, "
                            f"got {type(barrier_fn).__name__}")
        if capture_error_mode not in CAPTURE_ERROR_MODES:
            raise ValueError(f"BreakableCUDAGraphCapture: capture_error_mode must be one of "
                             f"{', '.join(CAPTURE_ERROR_MODES)}; got {capture_error_mode!r}")
        self.graph = graph
        self.pool = pool
        self.stream = stream
        self.capture_error_mode = capture_error_mode
        self.barrier_fn = barrier_fn
        self.check_leaks = check_leaks
        self.in_break = False
        self._marked: list[torch.Tensor] = []  # mark_break_output() of the running break
        self._segment: Any = None
        self._side_streams: list[torch.cuda.Stream] = []
        self._fork_sites: list[str] = []  # where each side stream first forked
        self._restore: list[Callable[[], None]] = []

    def __enter__(self) -> BreakableCUDAGraphCapture:
        if _current_capture.get() is not None:
            raise RuntimeError(
                "BreakableCUDAGraphCapture cannot be nested: finish the active capture "
                "before starting another"
            )
        self.pool = self.pool if self.pool is not None else backend.graph_pool_handle()
        self.graph._begin_capture(self.pool)
        caller_stream = backend.current_stream()
        self.stream = self.stream if self.stream is not None else backend.new_stream()
        self.stream.wait_stream(caller_stream)
        stream_context = backend.stream_context(self.stream)
        stream_context.__enter__()
        capture_token = _current_capture.set(self)
        stream_token = _current_stream.set(self.stream)
        _wait_stream_tracker.install(backend.stream_class)
        self._restore = [
            _wait_stream_tracker.uninstall,
            lambda: caller_stream.wait_stream(self.stream),
            lambda: stream_context.__exit__(None, None, None),
            lambda: _current_stream.reset(stream_token),
            lambda: _current_capture.reset(capture_token),
        ]
        try:
            if self.check_leaks:
                backend.start_recording_allocations()
            self._begin_segment()
        except BaseException:
            self._unwind()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if exc_type is None:
                self._end_segment()
                self.graph._finish_capture()
            else:
                self._abort()
        except BaseException:
            self._abort()
            raise
        finally:
            self._unwind()
        return False

    def fork(self, side_stream: torch.cuda.Stream) -> None:
        """Make `side_stream` part of the capture; it is joined before every segment ends
        and forked again when the next segment begins."""
        side_stream.wait_stream(self.stream)
        self.track_fork(side_stream)

    def track_fork(self, side_stream: torch.cuda.Stream) -> None:
        """Record that `side_stream` forked from the capture stream (idempotent)."""
        if side_stream not in self._side_streams:
            self._side_streams.append(side_stream)
            self._fork_sites.append(self._position())

    def mark_outputs(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self._marked.extend(tensors)

    def _check_leaks(self, fn: Callable, before: dict, result: Any) -> None:
        """Memory the break allocated that outlives it, is not part of its result and was
        not marked: a replay would run with it freed or reused (the bug weak references
        cause), so refuse it now with what allocated it."""
        kept = [(storage.data_ptr(), storage.data_ptr() + storage.nbytes())
                for storage in (t.untyped_storage() for t in [*tensors_in(result),
                                                              *self._marked])]
        # A block is new unless the same address held a block of the same size and stack
        # before the break (one freed and reallocated in place is new).
        leaked = {address: info for address, info in backend.live_blocks().items()
                  if before.get(address) != info
                  and not any(start <= address < end or address <= start < address + info[0]
                              for start, end in kept)}
        if leaked:
            lines = [f"  {size} bytes at {address:#x}, allocated at:\n{_format_frames(frames)}"
                     for address, (size, frames) in leaked.items()]
            raise RuntimeError(
                f"graph break {fn.__module__}.{fn.__qualname__} leaked {len(leaked)} CUDA "
                f"allocation(s) that outlive it but are not in its result: if a later "
                f"segment reads them, each replay reads memory freed or reused since the "
                f"capture. Return them, write into a tensor allocated before the break, or "
                f"mark_break_output() what the break keeps on purpose (a workspace a library "
                f"makes lazily is reported too: warm the code up before capturing).\n"
                + "\n".join(lines))

    def _position(self) -> str:
        breaks = self.graph.num_breaks
        return f"segment {breaks}" + (f" (after break {breaks - 1})" if breaks else "")

    def run_break(self, fn: Callable, args: tuple, kwargs: dict, stub: Callable | None) -> Any:
        """End the segment, run `fn` (or its capture stub) eagerly, record it, begin anew."""
        self._end_segment()
        if self.barrier_fn is not None:
            self.barrier_fn()
        before = backend.live_blocks() if self.check_leaks else None
        self.in_break, self._marked = True, []
        try:
            result = (stub or fn)(*args, **kwargs)
        finally:
            self.in_break = False
        if before is not None:
            self._check_leaks(fn, before, result)
        self.graph._add_break(fn, args, kwargs, result)
        self._begin_segment()
        return result

    def _begin_segment(self) -> None:
        segment = backend.new_segment()
        segment.capture_begin(pool=self.pool, capture_error_mode=self.capture_error_mode)
        self._segment = segment
        for side_stream in self._side_streams:
            side_stream.wait_stream(self.stream)

    def _end_segment(self) -> None:
        for side_stream in self._side_streams:
            self.stream.wait_stream(side_stream)
        segment, self._segment = self._segment, None
        try:
            empty = _end_and_check_empty(segment)
        except RuntimeError as error:
            backend.reset_generators()
            raise RuntimeError(self._end_failed_message(error)) from error
        self.graph._add_segment(segment, empty=empty)

    def _end_failed_message(self, error: RuntimeError) -> str:
        first_line = str(error).splitlines()[0]
        message = f"{self._position()} of the capture could not end ({first_line})"
        if "unjoined" not in str(error).lower():
            return message
        forks = "; ".join(f"{stream} forked in {site}" for stream, site
                          in zip(self._side_streams, self._fork_sites, strict=True))
        return (f"{message}. A stream forked from the capture stream must be joined back "
                f"before a segment ends; bcg joins the ones forked with fork_stream() or "
                f"wait_stream() ({forks or 'none were'}), but not a fork through an event: "
                f"join that stream yourself (capture_stream.wait_stream(side)) before the "
                f"break")

    def _abort(self) -> None:
        segment, self._segment = self._segment, None
        if segment is not None:
            abandon_capture(segment)
            self.graph._add_segment(segment, empty=True)
        self.graph.reset()

    def _unwind(self) -> None:
        while self._restore:
            self._restore.pop()()


class CaptureNeedsWarmUp(RuntimeError):
    """Raised by code that meets, during a capture, work a capture forbids (compiling or
    loading a kernel: `cuModuleLoadData` is refused while a stream captures). The caller
    abandons the capture, runs the same inputs eagerly once, and captures again."""


def abandon_capture(graph: Any) -> None:
    """End the capture of a CUDA graph whose capture failed midway, so the caller's error
    stands. If ending fails too (the capture was invalidated), torch's generators are left
    marked as capturing: unmark them, or every later random op in the process raises."""
    try:
        graph.capture_end()
    except Exception:
        backend.reset_generators()


def _end_and_check_empty(segment: Any) -> bool:
    """End the capture of `segment`; True if it recorded no work (torch warns then)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        segment.capture_end()
    empty = False
    for warning in caught:
        if _EMPTY_GRAPH_WARNING in str(warning.message):
            empty = True
        else:
            warnings.warn_explicit(
                warning.message, warning.category, warning.filename, warning.lineno
            )
    return empty


def _format_frames(frames: list) -> str:
    shown = [f"    {f.get('filename', '?')}:{f.get('line', '?')} {f.get('name', '?')}"
             for f in frames if isinstance(f, dict) and "/torch/" not in f.get("filename", "")]
    return "\n".join(shown[:8]) or "    (no stack recorded)"
