"""Small helpers every package uses."""

from __future__ import annotations

import functools
import logging
import numbers
import os
import re
import socket

# A Python string holds a surrogate code point only alone: JSON's "\\ud800" escapes, and
# bytes that are not UTF-8, read from the command line or a file ("surrogateescape"), make one.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


SWITCH_VALUES = {"1": True, "on": True, "true": True, "yes": True,
                 "0": False, "off": False, "false": False, "no": False}


def switch_from_environment(name: str) -> bool:
    """The on/off environment variable `name` (unset: on); any other value is refused."""
    value = os.environ.get(name)
    if value is None:
        return True
    if value.strip().lower() not in SWITCH_VALUES:
        raise ValueError(f"{name} must be 1 or 0 (on/off, true/false, yes/no), got {value!r}")
    return SWITCH_VALUES[value.strip().lower()]


def cdiv(a: int, b: int) -> int:
    """Ceiling division of integers (on the host: `triton.cdiv` costs microseconds a call)."""
    return -(-a // b)


def leading_single_tokens(num_new_tokens: list[int]) -> int:
    """How many sequences at the front of a batch add one token each (its decodes)."""
    for index, count in enumerate(num_new_tokens):
        if count != 1:
            return index
    return len(num_new_tokens)


def is_int(value) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_token_id(value) -> bool:
    """An integer of any kind (numpy's too, as tokenized datasets hold them), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def one_line(error: BaseException, limit: int | None = None) -> str:
    """An error's message on one line, for a one-line error report (library messages, from
    transformers or uvicorn, may run to paragraphs): its lines joined by single spaces, cut
    to `limit` characters; the error's type if the message is empty."""
    text = " ".join(str(error).split()) or type(error).__name__
    if limit is not None and len(text) > limit:
        text = text[: limit - 3] + "..."
    return text


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now (for a process group or a server
    started next)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def invalid_unicode(text: str) -> str | None:
    """Why `text` is not valid Unicode (no tokenizer can encode it), or None: where its
    first lone UTF-16 surrogate is."""
    found = LONE_SURROGATE.search(text)
    if found is None:
        return None
    return (f"holds a lone UTF-16 surrogate (\\u{ord(found.group()):04x}) at character "
            f"{found.start()}, which is not valid Unicode (bytes that are not UTF-8, read "
            "from the command line or a file, arrive as such)")


@functools.cache
def warn_once(logger_name: str, message: str) -> None:
    """Log `message` as a warning once a process (the command line resolves a model before
    its engine does it again)."""
    logging.getLogger(logger_name).warning(message)
