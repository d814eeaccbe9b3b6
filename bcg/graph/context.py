"""Scoped flags and per-capture/per-replay state that model code may read.

Everything here lives in ContextVars, so it is isolated per thread (and per asyncio
task) and restored exactly when a scope exits, exceptions included.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

_breakable_enabled: ContextVar[bool] = ContextVar("bcg_breakable_enabled", default=False)
_current_stream: ContextVar[torch.cuda.Stream | None] = ContextVar(
    "bcg_current_stream", default=None
)
_replay_token: ContextVar[int | None] = ContextVar("bcg_replay_token", default=None)
_replay_counter = itertools.count(1)


@contextmanager
def enable_breakable_cuda_graph(enabled: bool = True) -> Iterator[None]:
    """Within this scope, model code should choose the breakable variant of its ops."""
    token = _breakable_enabled.set(enabled)
    try:
        yield
    finally:
        _breakable_enabled.reset(token)


def is_in_breakable_cuda_graph() -> bool:
    """True inside `enable_breakable_cuda_graph()` in this thread/context."""
    return _breakable_enabled.get()


def get_current_stream() -> torch.cuda.Stream:
    """The stream a break body should use: the capture stream while capturing, else the
    current stream (which is the replay stream during `replay()`)."""
    stream = _current_stream.get()
    return stream if stream is not None else torch.cuda.current_stream()


def get_current_replay_token() -> int | None:
    """An id unique to the `replay()` call now running (None outside a replay), so a
    break body can build per-step metadata once and reuse it in every later break."""
    return _replay_token.get()


def next_replay_token() -> int:
    return next(_replay_counter)
