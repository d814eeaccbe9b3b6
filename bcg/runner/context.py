"""The forward context: what the attention op reads instead of taking it as arguments.

The runner sets it around every forward (eager call or graph replay), so a graph break
replayed with capture-time arguments still sees the live batch of this step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from bcg.runner.forward_batch import ForwardBatch
from bcg.runner.kv_cache import KVCache


@dataclass
class ForwardContext:
    batch: ForwardBatch
    kv_cache: KVCache
    attention_scales: list[float]  # softmax scale of each attention layer, by layer id
    # Split count and workspace of the decode kernel, built once per step (or per decode
    # graph bucket, whose replays all reuse it): layers must not allocate their own.
    decode_plan: Any = None


_current: ContextVar[ForwardContext | None] = ContextVar("bcg_forward_context", default=None)


@contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[None]:
    token = _current.set(context)
    try:
        yield
    finally:
        _current.reset(token)


def get_forward_context() -> ForwardContext:
    context = _current.get()
    if context is None:
        raise RuntimeError(
            "attention ran outside a forward context: run the model through ModelRunner, "
            "or wrap the call in bcg.runner.context.set_forward_context(...)"
        )
    return context
