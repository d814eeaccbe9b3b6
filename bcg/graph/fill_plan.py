"""Fill plans: every view one `GraphBufferRegistry.fill_from` writes or reads, sliced once
per sizes and source shapes (the registry caches them), with head copies and tail resets
grouped so that a fill issues one copy per dtype pair on a GPU."""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import torch

from bcg.graph.slots import FillContext, GraphSlot, PaddingPolicy

# Pad-source views kept per reset slot, one per tail layout (shape and strides).
MAX_CACHED_PAD_VIEWS = 1024
# A destination buffer's (device, dtype, is_cpu).
_CopyKind = tuple[torch.device, torch.dtype, bool]


class Head:
    """Lands one slot's source in the leading block of its buffer. A plan is built for
    every new size, so what a destination view needs is precomputed here."""

    __slots__ = ("slot", "kind", "_capacity", "_stride", "_offset")

    def __init__(self, slot: GraphSlot) -> None:
        buffer = slot.buffer
        self.slot = slot
        self.kind = _copy_kind(slot)
        self._capacity = tuple(buffer.shape)
        self._stride = buffer.stride()
        self._offset = buffer.storage_offset()

    def view_for(self, src: Any) -> torch.Tensor:
        """The block of the buffer `src` is copied into: `src`'s shape, at the start."""
        name = self.slot.name
        if not isinstance(src, torch.Tensor):
            raise TypeError(
                f"the source of slot {name!r} is {type(src).__name__}, not a tensor; give "
                f"the slot a source_fn that returns a tensor (or None to skip it)"
            )
        shape = src.shape
        if len(shape) != len(self._capacity) or any(map(operator.gt, shape, self._capacity)):
            raise ValueError(
                f"the source of slot {name!r} has shape {tuple(shape)}, which does not fit "
                f"its buffer {self._capacity} (same number of dims, none longer); raise the "
                f"registry's max_bs / max_num_tokens or run this batch eagerly"
            )
        return self.slot.buffer.as_strided(shape, self._stride, self._offset)


class Reset:
    """Resets one ZERO / FILL_SENTINEL slot's tail: a copy from its pad source, a constant
    tensor laid out like the buffer, grouped with the head copies."""

    __slots__ = ("slot", "value", "kind", "_pad", "_pad_views")

    def __init__(self, slot: GraphSlot) -> None:
        self.slot = slot
        self.value = 0 if slot.padding_policy is PaddingPolicy.ZERO else slot.pad_value
        self.kind = _copy_kind(slot)
        self._pad = _pad_source(slot.buffer, self.value)
        self._pad_views: dict[tuple, torch.Tensor] = {}

    def pad_view(self, tail: torch.Tensor, raw: int, padded: int) -> torch.Tensor:
        """The pad source's twin of `tail`, the view `[raw:padded]`. All such views hold
        the pad value only, so one per layout serves every position: a new plan mostly
        finds it here instead of slicing again."""
        layout = (tail.shape, tail.stride())
        view = self._pad_views.get(layout)
        if view is None:
            if len(self._pad_views) >= MAX_CACHED_PAD_VIEWS:
                self._pad_views.clear()
            view = self._pad_views[layout] = self.slot._span_of(self._pad, raw, padded)
        return view


class CopyGroup(NamedTuple):
    """Copies issued by one call: `dsts` are the head views (sourced from the fill's
    sources at `source_indices`, in order) followed by the tail views (sourced from
    `pads`, their twin views of the pad sources)."""

    dsts: list[torch.Tensor]
    source_indices: list[int]
    pads: list[torch.Tensor]
    on_cpu: bool


class FillPlan(NamedTuple):
    """Everything one fill does for given sizes and source shapes, with its views sliced."""

    lone_resets: list[tuple[torch.Tensor, int | float | bool]]  # tails a head may overlap
    copies: list[CopyGroup]
    hooks: list[tuple[GraphSlot, torch.Tensor]]
    ctx: FillContext


def _copy_kind(slot: GraphSlot) -> _CopyKind:
    """What every copy into the slot's buffer shares: its device and dtype (and whether
    that device is the CPU, asked here once rather than on every plan)."""
    buffer = slot.buffer
    return (buffer.device, buffer.dtype, buffer.is_cpu)


def group_for(
    groups: dict[tuple, CopyGroup],
    kind: _CopyKind,
    src_dtype: torch.dtype,
    dst: torch.Tensor,
) -> CopyGroup:
    # torch._foreach_copy_ takes one (dst, src) dtype pair per call, and copies a whole call
    # in one launch only if every pair is dense with equal strides; a single strided view
    # (e.g. a partly filled 2-D buffer) makes it copy pair by pair, so those go apart.
    key = (kind, src_dtype, dst.is_contiguous())
    group = groups.get(key)
    if group is None:
        group = groups[key] = CopyGroup([], [], [], kind[2])
    return group


def copy_group(dsts: list[torch.Tensor], srcs: list[torch.Tensor], on_cpu: bool) -> None:
    if on_cpu:
        # In list order: head copies first, so a tail wrongly grouped with the head it
        # overlaps would clobber it here and fail the CPU tests.
        for dst, src in zip(dsts, srcs, strict=True):
            dst.copy_(src)
    else:
        torch._foreach_copy_(dsts, srcs)


def head_meets_tail(
    slot: GraphSlot, landed: tuple[torch.Size, torch.Tensor] | None, tail: torch.Tensor, raw: int
) -> bool:
    """Whether the slot's head (source shape, view), if any, shares an element with its
    tail `[raw:padded]`. Without slice_fn both are blocks of the buffer along dim 0 (the
    head from 0, the tail from `raw`, over all other positions), so they meet exactly when
    the head is not empty and runs past `raw`; a slice_fn slot compares storage ranges."""
    if landed is None:
        return False
    shape, head = landed
    if slot.slice_fn is None:
        return shape[0] > raw and all(shape)
    return ranges_meet(element_range(head), element_range(tail))


def _pad_source(buffer: torch.Tensor, value: int | float | bool) -> torch.Tensor:
    """A constant tensor with `buffer`'s shape and strides holding `value`: any tail view
    of the buffer has a twin view here, as long and laid out alike, to copy from."""
    pad = torch.empty_strided(
        buffer.shape, buffer.stride(), dtype=buffer.dtype, device=buffer.device
    )
    return pad.fill_(value)


def element_range(tensor: torch.Tensor) -> tuple[int, int]:
    """The storage elements `[first, last + 1)` a tensor spans; empty if it has none."""
    if tensor.numel() == 0:
        return (0, 0)
    first = tensor.storage_offset()
    last = first + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return first, last + 1


def ranges_meet(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < a[1] and b[0] < b[1] and a[0] < b[1] and b[0] < a[1]
