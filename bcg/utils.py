"""Small helpers every package uses."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of integers (on the host: `triton.cdiv` costs microseconds a call)."""
    return -(-a // b)
