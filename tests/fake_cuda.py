"""A fake CUDA backend that records "kernels" at capture and re-runs them at replay, so
the breakable-capture protocol can be tested on a machine without a GPU."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable

import torch


class FakeStream:
    def __init__(self, backend: FakeBackend, name: str) -> None:
        self.backend = backend
        self.name = name

    def wait_stream(self, other: FakeStream) -> None:
        self.backend.log.append(f"{self.name}<-{other.name}")

    def __repr__(self) -> str:
        return f"<FakeStream {self.name}>"


class FakeSegment:
    def __init__(self, backend: FakeBackend) -> None:
        self.backend = backend
        self.kernels: list[Callable[[], None]] = []
        self.was_reset = False

    def capture_begin(self, pool=None, capture_error_mode="global") -> None:
        assert self.backend.recording is None, "capture_begin while another segment records"
        self.backend.recording = self
        self.backend.log.append(f"begin(pool={pool},mode={capture_error_mode})")

    def capture_end(self) -> None:
        assert self.backend.recording is self
        self.backend.recording = None
        if self.backend.unjoined_work:  # CUDA's error for a forked stream left unjoined
            raise RuntimeError("CUDA error: capturing stream has unjoined work\nmore lines")
        if self.backend.invalidated:  # e.g. a synchronising call during the capture
            raise RuntimeError("CUDA error: operation failed due to a previous error during "
                               "capture\nmore lines")
        self.backend.log.append("end")
        if not self.kernels:
            warnings.warn("The CUDA Graph is empty. This usually means ...", stacklevel=2)

    def replay(self) -> None:
        self.backend.log.append("replay")
        for kernel in self.kernels:
            kernel()

    def reset(self) -> None:
        self.was_reset = True


class FakeStreamContext:
    def __init__(self, backend: FakeBackend, stream: FakeStream) -> None:
        self.backend, self.stream, self.previous = backend, stream, None

    def __enter__(self):
        self.previous, self.backend.stream = self.backend.stream, self.stream

    def __exit__(self, *exc):
        self.backend.stream = self.previous


class FakeBackend:
    stream_class = FakeStream

    def __init__(self) -> None:
        self.log: list[str] = []
        self.recording: FakeSegment | None = None
        self.stream = FakeStream(self, "default")
        self.segments: list[FakeSegment] = []
        self.pools = 0
        self.unjoined_work = False
        self.invalidated = False
        self.generators_reset = 0
        self.recording_allocations = False
        self.allocations: dict[int, tuple[weakref.ref, str]] = {}  # address: (tensor, site)

    def allocate(self, numel: int, site: str) -> torch.Tensor:
        """A tensor the fake allocator reports while it lives, allocated at `site`."""
        tensor = torch.empty(numel)
        self.allocations[tensor.data_ptr()] = (weakref.ref(tensor), site)
        return tensor

    def start_recording_allocations(self) -> None:
        self.recording_allocations = True

    def live_blocks(self) -> dict[int, tuple[int, list]]:
        return {address: (ref().untyped_storage().nbytes(), [{"filename": site, "line": 1,
                                                             "name": "alloc"}])
                for address, (ref, site) in self.allocations.items() if ref() is not None}

    def launch(self, kernel: Callable[[], None]) -> None:
        """Record a kernel while capturing (not run, like CUDA), else run it now."""
        if self.recording is not None:
            self.recording.kernels.append(kernel)
        else:
            kernel()

    def new_segment(self) -> FakeSegment:
        self.segments.append(FakeSegment(self))
        return self.segments[-1]

    def graph_pool_handle(self):
        self.pools += 1
        return ("pool", self.pools)

    def new_stream(self) -> FakeStream:
        return FakeStream(self, "capture")

    def current_stream(self) -> FakeStream:
        return self.stream

    def stream_context(self, stream: FakeStream) -> FakeStreamContext:
        return FakeStreamContext(self, stream)

    def reset_generators(self) -> None:
        self.generators_reset += 1
