"""Numerical checks the tests share: one relative error, and one poison for memory that the
code under test must leave alone.

Poison is a value no computation here produces (``POISON``, exact in every dtype the tests
use), written before the code under test runs: memory that still holds it afterwards was not
written. Inputs that must never be *read* are padded with NaN instead, which any read spreads
into the result.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

POISON = 99


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|, in fp32 on `ours`' device."""
    ours, ref = ours.float(), ref.float().to(ours.device)
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def poison(tensor: torch.Tensor, value: float = POISON) -> torch.Tensor:
    """Fill `tensor` with `value` in place; return it."""
    return tensor.fill_(value)


def poisoned_like(tensor: torch.Tensor, value: float = POISON) -> torch.Tensor:
    """A new tensor of `tensor`'s shape, dtype and device, all `value`."""
    return poison(torch.empty_like(tensor), value)


def pad_with_nan(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` followed by `rows` rows of NaN: padding that must never be read."""
    padding = poison(tensor.new_empty(rows, *tensor.shape[1:]), float("nan"))
    return torch.cat([tensor, padding])


def poison_registry(registry, keep: Iterable[str] = ()) -> None:
    """Poison every static buffer of a ``GraphBufferRegistry`` but those named in `keep`."""
    for name in registry.slot_names():
        if name not in keep:
            poison(registry.get_slot(name).buffer)
