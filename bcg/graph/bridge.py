"""Bridge buffers: what crosses a graph break, in buffers shared by every layer of a runner.

A break holds strong references to its arguments and result (weak ones let a later capture
reuse their memory: silent wrong output). If every layer hands its break fresh tensors, the
graph pool must keep every layer's, and the blocks they pin split the pool so that the
larger temporaries of each layer take new memory too: the pool grows as layers x tokens.
Instead, the segment before a break writes what crosses it into a bridge buffer: one per
name, allocated at the largest size asked for (capture the largest size first) and handed
out as views, so the pool holds about one layer's activations. A bridge may carry only a
value that is dead before the same name is asked for again (in a layer stack: one layer's).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch


class BridgeBuffers:
    """One set of bridge buffers; a graph runner keeps one for all its captures."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def view(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        """A contiguous `shape` view at the start of the buffer `name`, grown if too small (a
        graph captured with the old buffer keeps it alive through its breaks)."""
        key = (name, dtype, device)
        numel = math.prod(shape)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel].view(shape)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


_active: ContextVar[BridgeBuffers | None] = ContextVar("bcg_bridge_buffers", default=None)


@contextmanager
def use_bridge_buffers(bridges: BridgeBuffers) -> Iterator[None]:
    """Make `bridge_buffer` hand out views of `bridges` (while a runner warms up and captures)."""
    token = _active.set(bridges)
    try:
        yield
    finally:
        _active.reset(token)


def bridge_buffer(name: str, shape: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor | None:
    """Where to write a value that crosses a graph break: a `shape` view of the active bridge
    buffer `name` while a runner warms up and captures, else None, to allocate as usual (eager
    steps, and compiled code, whose memory the compiler plans)."""
    if torch.compiler.is_compiling():
        return None
    bridges = _active.get()
    return None if bridges is None else bridges.view(name, shape, dtype, device)
