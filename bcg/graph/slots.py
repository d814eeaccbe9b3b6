"""Declarative static input buffers for graph runners: what one buffer is.

A captured graph reads its inputs from fixed addresses, so before every replay a runner
copies the live batch into static buffers and must leave safe values in the padded tail
(a stale tail can index the KV cache out of bounds). Each buffer is described once, as a
`GraphSlot` mirroring one field of the batch, with a `PaddingPolicy` for its tail. The
batch is any dataclass; nothing here knows about LLMs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch


class PaddingPolicy(Enum):
    """What `fill_from` leaves in a slot's padded tail `[raw:padded]` along its axis."""

    KEEP_PAD = "keep_pad"  # left alone: the caller proves the graph never reads it
    FOREACH_COPY = "foreach_copy"  # default: head copied, tail left as is
    ZERO = "zero"  # reset to 0 before each fill (index-like buffers: positions, cache slots)
    FILL_SENTINEL = "fill_sentinel"  # reset to pad_value before each fill (e.g. seq lengths)
    FILL_ONCE = "fill_once"  # whole buffer set to pad_value at registration, never reset


RESET_POLICIES = (PaddingPolicy.ZERO, PaddingPolicy.FILL_SENTINEL)
_PAD_VALUE_POLICIES = (PaddingPolicy.FILL_SENTINEL, PaddingPolicy.FILL_ONCE)
_AXES = ("bs", "tokens", "none")


@dataclass(frozen=True, slots=True)
class FillContext:
    """The sizes of one `fill_from` call, handed to `post_fill` hooks."""

    raw_bs: int
    padded_bs: int
    raw_num_tokens: int
    padded_num_tokens: int


ShapeFn = Callable[[int, int], "int | Sequence[int]"]
SliceFn = Callable[[torch.Tensor, int, int], torch.Tensor]
PostFillFn = Callable[[torch.Tensor, Any, FillContext], None]
SourceFn = Callable[[Any], "torch.Tensor | None"]


@dataclass(eq=False)
class GraphSlot:
    """One static buffer, mirroring the batch field `name`.

    `shape_fn(max_bs, max_num_tokens)` gives the buffer's full shape. `axis` ("bs",
    "tokens" or "none") says which count the padded tail runs along; "none" means the
    graph reads the whole buffer. `slice_fn(buffer, start, stop)` returns positions
    `[start, stop)` along the axis, for buffers whose axis is not the first dim (e.g.
    `lambda b, start, stop: b[:, start:stop]` for a `[3, tokens]` buffer).

    Each fill copies the source (the batch field, or `source_fn(batch)` when given; None
    skips it) into the leading block of the buffer with the source's shape, unless
    `copy_from_batch` is False. `post_fill(view, batch, ctx)` then runs on the padded
    view, to compute or adjust the buffer. Disabled slots are never allocated.
    """

    name: str
    shape_fn: ShapeFn
    dtype: torch.dtype
    axis: str = "tokens"
    device: torch.device | str | None = None
    padding_policy: PaddingPolicy = PaddingPolicy.FOREACH_COPY
    pad_value: int | float | bool | None = None
    enabled: bool = True
    copy_from_batch: bool = True
    post_fill: PostFillFn | None = None
    slice_fn: SliceFn | None = None
    source_fn: SourceFn | None = None
    buffer: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        _validate_slot(self)

    @property
    def is_computed(self) -> bool:
        """True when a hook computes (part of) the buffer, so a graph always reads it."""
        return self.post_fill is not None or not self.copy_from_batch

    def span(self, start: int, stop: int) -> torch.Tensor:
        """The view of positions `[start, stop)` along the slot's axis."""
        return self._span_of(self._allocated_buffer(), start, stop)

    def slice_for(self, padded_bs: int, padded_num_tokens: int) -> torch.Tensor:
        """The view a graph captured for this padded size reads."""
        if self.axis == "bs":
            return self.span(0, padded_bs)
        if self.axis == "tokens":
            return self.span(0, padded_num_tokens)
        return self._allocated_buffer()

    def _span_of(self, tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        # Also slices the slot's pad source, which has the buffer's shape and strides.
        if self.slice_fn is not None:
            return self.slice_fn(tensor, start, stop)
        return tensor[start:stop]

    def _allocated_buffer(self) -> torch.Tensor:
        if self.buffer is None:
            raise RuntimeError(
                f"GraphSlot {self.name!r} has no buffer yet: slice the slot returned by "
                f"GraphBufferRegistry.register_slot (or registry.get_slot({self.name!r}))"
            )
        return self.buffer


def _validate_slot(slot: GraphSlot) -> None:
    where = f"GraphSlot {slot.name!r}"
    if slot.axis not in _AXES:
        raise ValueError(f"{where}: axis must be one of {_AXES}, got {slot.axis!r}")
    if not isinstance(slot.padding_policy, PaddingPolicy):
        raise TypeError(f"{where}: padding_policy must be a PaddingPolicy member")
    needs_pad_value = slot.padding_policy in _PAD_VALUE_POLICIES
    if needs_pad_value and slot.pad_value is None:
        raise ValueError(f"{where}: {slot.padding_policy.name} needs a pad_value")
    if not needs_pad_value and slot.pad_value is not None:
        raise ValueError(
            f"{where}: {slot.padding_policy.name} ignores pad_value; drop it, or use "
            f"FILL_SENTINEL / FILL_ONCE to pad with a value"
        )
    if slot.axis == "none" and slot.padding_policy in RESET_POLICIES:
        raise ValueError(
            f"{where}: axis='none' has no padded tail to reset; give the slot a 'bs' or "
            f"'tokens' axis, or use KEEP_PAD / FOREACH_COPY / FILL_ONCE"
        )
    if slot.axis == "none" and slot.slice_fn is not None:
        raise ValueError(f"{where}: slice_fn needs an axis to slice along, not axis='none'")
    if not slot.copy_from_batch and slot.source_fn is not None:
        raise ValueError(f"{where}: source_fn is unused when copy_from_batch=False; drop one")
