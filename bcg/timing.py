"""Start-up timing: how long each part of building an engine takes, logged as it ends and
kept until the engine takes them (`take_startup_steps`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("bcg.startup")

_finished: dict[str, float] = {}  # this process's steps since the last take, in order
_open: list[str] = []  # the steps under way, outermost first


@contextmanager
def startup_step(what: str) -> Iterator[None]:
    """Log `what` and its seconds when the block ends (shown with `-v`)."""
    _open.append(what)
    key = " > ".join(_open)  # a step inside another is named under it
    start = time.perf_counter()
    try:
        yield
    finally:
        _open.pop()
    seconds = time.perf_counter() - start
    _finished[key] = _finished.get(key, 0.0) + seconds
    logger.info("start-up: %s in %.2f s", what, seconds)


def take_startup_steps() -> dict[str, float]:
    """The steps finished since the last call, in the order they ended (a step inside
    another as "outer > inner", before the outer one), and forget them."""
    steps = dict(_finished)
    _finished.clear()
    return steps
