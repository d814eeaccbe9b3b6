"""Graph breaks: functions that run eagerly between the segments of a breakable graph."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, overload

import torch

from bcg.graph.capture import current_capture

F = TypeVar("F", bound=Callable[..., Any])


@overload
def eager_on_graph(fn: F) -> F: ...
@overload
def eager_on_graph(
    enable: bool = True, *, capture_stub: Callable | None = None
) -> Callable[[F], F]: ...


def eager_on_graph(fn_or_enable: Any = True, *, enable: bool | None = None, capture_stub=None):
    """Mark a function as a graph break.

    Bare (`@eager_on_graph`) or configured (`@eager_on_graph(enable=True,
    capture_stub=None)`, also `@eager_on_graph(True)`). Inside an active
    `BreakableCUDAGraphCapture` a call ends the current segment, runs eagerly (or runs
    `capture_stub` instead, at capture only), is recorded for replay with strong
    references to its arguments and result, and the next segment begins. Elsewhere,
    and inside another break's body, it is a plain call. `enable=False` returns the
    function unchanged.

    At replay the function runs again with the capture-time argument objects. Prefer
    the with-output style: write into an output allocated before the break and return
    None, so nothing is copied. A returned result is written back into the capture-time
    result by `copy_output`.
    """
    if capture_stub is not None and not callable(capture_stub):
        raise TypeError(f"eager_on_graph: capture_stub must be callable or None, got "
                        f"{type(capture_stub).__name__}")
    if callable(fn_or_enable):
        return _make_break(fn_or_enable, capture_stub)
    enabled = fn_or_enable if enable is None else enable
    if not isinstance(enabled, bool):
        raise TypeError(f"eager_on_graph: enable must be a bool (or decorate a function), got "
                        f"{type(enabled).__name__}")

    def decorate(fn: F) -> F:
        return _make_break(fn, capture_stub) if enabled else fn

    return decorate


def _make_break(fn: F, capture_stub: Callable | None) -> F:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        capture = current_capture()
        if capture is None or capture.in_break:
            return fn(*args, **kwargs)
        return capture.run_break(fn, args, kwargs, capture_stub)

    return wrapper  # type: ignore[return-value]


@eager_on_graph
def break_graph() -> None:
    """A no-op break: forces a segment split at this point of the capture."""


def fork_stream(side_stream: torch.cuda.Stream) -> torch.cuda.Stream:
    """Fork `side_stream` from the current stream and return it.

    Inside a capture the side stream is also joined before each segment ends and forked
    again after each break, so work on it may span a break. Join it yourself as usual
    (`torch.cuda.current_stream().wait_stream(side_stream)`) when its results are needed.
    """
    capture = current_capture()
    if capture is None:
        side_stream.wait_stream(torch.cuda.current_stream())
    else:
        capture.fork(side_stream)
    return side_stream


def mark_break_output(*tensors: torch.Tensor) -> None:
    """Inside a break body: these tensors outlive the break on purpose (e.g. a cache it
    fills), so the leak check (`check_leaks=True`) does not report them."""
    capture = current_capture()
    if capture is not None and capture.in_break:
        capture.mark_outputs(tensors)
