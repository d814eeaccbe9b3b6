"""Start-up timing: how long each part of building an engine takes, logged as it ends."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("bcg.startup")


@contextmanager
def startup_step(what: str) -> Iterator[None]:
    """Log `what` and its seconds when the block ends (shown with `-v`)."""
    start = time.perf_counter()
    yield
    logger.info("start-up: %s in %.2f s", what, time.perf_counter() - start)
