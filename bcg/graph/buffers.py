"""Declarative static input buffers for graph runners.

A captured graph reads its inputs from fixed addresses, so before every replay a runner
copies the live batch into static buffers and must leave safe values in the padded tail
(a stale tail can index the KV cache out of bounds). A `GraphBufferRegistry` describes
each buffer once, as a `GraphSlot` mirroring one field of the batch, and every runner
fills its buffers the same way. The batch is any dataclass; nothing here knows about LLMs.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from bcg.graph.buffer_pool import normalize_device, share_buffer


class PaddingPolicy(Enum):
    """What `fill_from` leaves in a slot's padded tail `[raw:padded]` along its axis."""

    KEEP_PAD = "keep_pad"  # left alone: the caller proves the graph never reads it
    FOREACH_COPY = "foreach_copy"  # default: head copied, tail left as is
    ZERO = "zero"  # reset to 0 before each fill (index-like buffers: positions, cache slots)
    FILL_SENTINEL = "fill_sentinel"  # reset to pad_value before each fill (e.g. seq lengths)
    FILL_ONCE = "fill_once"  # whole buffer set to pad_value at registration, never reset


_RESET_POLICIES = (PaddingPolicy.ZERO, PaddingPolicy.FILL_SENTINEL)
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
        buffer = self._allocated_buffer()
        if self.slice_fn is not None:
            return self.slice_fn(buffer, start, stop)
        return buffer[start:stop]

    def slice_for(self, padded_bs: int, padded_num_tokens: int) -> torch.Tensor:
        """The view a graph captured for this padded size reads."""
        if self.axis == "bs":
            return self.span(0, padded_bs)
        if self.axis == "tokens":
            return self.span(0, padded_num_tokens)
        return self._allocated_buffer()

    def source(self, batch: Any) -> torch.Tensor | None:
        """The live tensor to copy from `batch`, or None to leave the buffer as is."""
        if self.source_fn is not None:
            return self.source_fn(batch)
        return getattr(batch, self.name, None)

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
    if slot.axis == "none" and slot.padding_policy in _RESET_POLICIES:
        raise ValueError(
            f"{where}: axis='none' has no padded tail to reset; give the slot a 'bs' or "
            f"'tokens' axis, or use KEEP_PAD / FOREACH_COPY / FILL_ONCE"
        )
    if slot.axis == "none" and slot.slice_fn is not None:
        raise ValueError(f"{where}: slice_fn needs an axis to slice along, not axis='none'")
    if not slot.copy_from_batch and slot.source_fn is not None:
        raise ValueError(f"{where}: source_fn is unused when copy_from_batch=False; drop one")


class GraphBufferRegistry:
    """The static input buffers of one graph runner, sized for `max_bs` / `max_num_tokens`.

    `fill_from` copies a live batch in before replay; `extract_buffer` gives the batch
    a graph is captured with. With `share_pool=True` buffers come from the process-wide
    pool (`share_buffer`), so runners that never replay at once share identical buffers.
    """

    def __init__(
        self,
        device: torch.device | str,
        max_bs: int,
        max_num_tokens: int,
        share_pool: bool = False,
    ) -> None:
        if max_bs < 1 or max_num_tokens < 1:
            raise ValueError(
                f"GraphBufferRegistry needs max_bs >= 1 and max_num_tokens >= 1, got "
                f"max_bs={max_bs}, max_num_tokens={max_num_tokens}"
            )
        self.device = normalize_device(device)
        self.max_bs = max_bs
        self.max_num_tokens = max_num_tokens
        self.share_pool = share_pool
        self._slots: dict[str, GraphSlot] = {}
        # Hot-path plans, built at registration so fill_from only walks flat lists.
        self._heads: list[_HeadCopy] = []
        self._bs_tails: list[_TailReset] = []
        self._token_tails: list[_TailReset] = []
        self._hooked: list[GraphSlot] = []

    def register_slot(self, slot: GraphSlot, bind: torch.Tensor | None = None) -> GraphSlot | None:
        """Allocate (or adopt `bind`, after checking its shape, dtype and device) the
        buffer of `slot`. Returns the registered copy of the slot, which holds the buffer,
        or None for a disabled slot (never allocated)."""
        if not slot.enabled:
            return None
        if slot.name in self._slots:
            raise ValueError(
                f"a slot named {slot.name!r} is already registered; each batch field gets "
                f"one slot (disable one declaration with enabled=False)"
            )
        slot = dataclasses.replace(slot)
        slot.buffer = self._buffer_for(slot, bind)
        if slot.padding_policy is PaddingPolicy.FILL_ONCE:
            slot.buffer.fill_(slot.pad_value)
        self._slots[slot.name] = slot
        self._plan(slot)
        return slot

    def has_slot(self, name: str) -> bool:
        """True if an enabled slot named `name` is registered."""
        return name in self._slots

    def get_slot(self, name: str) -> GraphSlot:
        """The registered slot named `name`."""
        if name not in self._slots:
            raise KeyError(
                f"no enabled slot named {name!r}; registered: {self.slot_names()} "
                f"(check the name, or that the slot was not registered with enabled=False)"
            )
        return self._slots[name]

    def slot_names(self) -> list[str]:
        """Names of the registered (enabled) slots, in registration order."""
        return list(self._slots)

    def fill_from(
        self,
        batch: Any,
        *,
        raw_bs: int,
        padded_bs: int,
        raw_num_tokens: int,
        padded_num_tokens: int,
    ) -> None:
        """Copy `batch` into the static buffers for a graph of the padded sizes: reset
        the tails the policies ask for, copy every head (few grouped copy launches), then
        run the `post_fill` hooks in registration order."""
        self._check_sizes(raw_bs, padded_bs, raw_num_tokens, padded_num_tokens)
        if raw_bs < padded_bs:
            for tail in self._bs_tails:
                tail.reset(raw_bs, padded_bs)
        if raw_num_tokens < padded_num_tokens:
            for tail in self._token_tails:
                tail.reset(raw_num_tokens, padded_num_tokens)
        self._copy_heads(batch)
        if self._hooked:
            ctx = FillContext(raw_bs, padded_bs, raw_num_tokens, padded_num_tokens)
            for slot in self._hooked:
                slot.post_fill(slot.slice_for(padded_bs, padded_num_tokens), batch, ctx)

    def extract_buffer(self, *, padded_bs: int, padded_num_tokens: int, template: Any) -> Any:
        """A copy of the dataclass `template` whose slot fields are the static views for
        the padded sizes (sharing the buffers' storage); other fields are kept. A plain
        slot whose template field is None stays None; computed slots are always set."""
        if not dataclasses.is_dataclass(template) or isinstance(template, type):
            raise TypeError(
                f"extract_buffer needs a dataclass instance as template, got "
                f"{type(template).__name__}"
            )
        self._check_sizes(padded_bs, padded_bs, padded_num_tokens, padded_num_tokens)
        views = {
            name: slot.slice_for(padded_bs, padded_num_tokens)
            for name, slot in self._slots.items()
            if slot.is_computed or getattr(template, name, None) is not None
        }
        missing = views.keys() - {f.name for f in dataclasses.fields(template)}
        if missing:
            raise TypeError(
                f"{type(template).__name__} has no field for the computed slots "
                f"{sorted(missing)}; add the fields or rename the slots to match"
            )
        return dataclasses.replace(template, **views)

    def _buffer_for(self, slot: GraphSlot, bind: torch.Tensor | None) -> torch.Tensor:
        shape = _as_shape(slot.shape_fn(self.max_bs, self.max_num_tokens))
        device = self.device if slot.device is None else normalize_device(slot.device)
        if bind is not None:
            _check_bind(slot, bind, shape, device)
            return bind
        if self.share_pool:
            return share_buffer(slot.name, shape, slot.dtype, device)
        return torch.zeros(shape, dtype=slot.dtype, device=device)

    def _plan(self, slot: GraphSlot) -> None:
        if slot.copy_from_batch:
            self._heads.append(_HeadCopy(slot))
        if slot.padding_policy in _RESET_POLICIES:
            tails = self._bs_tails if slot.axis == "bs" else self._token_tails
            tails.append(_TailReset(slot))
        if slot.post_fill is not None:
            self._hooked.append(slot)

    def _check_sizes(
        self, raw_bs: int, padded_bs: int, raw_num_tokens: int, padded_num_tokens: int
    ) -> None:
        if not (
            0 <= raw_bs <= padded_bs <= self.max_bs
            and 0 <= raw_num_tokens <= padded_num_tokens <= self.max_num_tokens
        ):
            raise ValueError(
                f"sizes must satisfy 0 <= raw <= padded <= max: got bs {raw_bs}/{padded_bs}"
                f"/{self.max_bs}, tokens {raw_num_tokens}/{padded_num_tokens}/"
                f"{self.max_num_tokens}; run batches beyond the registry's limits eagerly"
            )

    def _copy_heads(self, batch: Any) -> None:
        # torch._foreach_copy_ takes one dtype pair per call, so group by (dst, src) dtype.
        groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for head in self._heads:
            src = head.slot.source(batch)
            if src is None:
                continue
            dst = head.destination(src)
            key = (head.group, src.dtype)
            group = groups.get(key)
            if group is None:
                group = groups[key] = ([], [])
            group[0].append(dst)
            group[1].append(src)
        for dsts, srcs in groups.values():
            _copy_group(dsts, srcs)


class _HeadCopy:
    """Copies one slot's source into the leading block of its buffer. Consecutive fills
    mostly bring the same source shape, so the destination view is kept, and what a new
    view needs is precomputed: slicing costs host time on every fill."""

    __slots__ = ("slot", "group", "_capacity", "_stride", "_offset", "_shape", "_view")

    def __init__(self, slot: GraphSlot) -> None:
        buffer = slot.buffer
        self.slot = slot
        self.group = (buffer.device, buffer.dtype)
        self._capacity = tuple(buffer.shape)
        self._stride = buffer.stride()
        self._offset = buffer.storage_offset()
        self._shape: torch.Size | None = None
        self._view: torch.Tensor | None = None

    def destination(self, src: Any) -> torch.Tensor:
        if not isinstance(src, torch.Tensor) or src.shape != self._shape:
            self._view = self._leading_block(src)
            self._shape = src.shape
        return self._view

    def _leading_block(self, src: Any) -> torch.Tensor:
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


class _TailReset:
    """Resets one slot's padded tail to its pad value, keeping the last tail view."""

    __slots__ = ("slot", "value", "_bounds", "_view")

    def __init__(self, slot: GraphSlot) -> None:
        self.slot = slot
        self.value = 0 if slot.padding_policy is PaddingPolicy.ZERO else slot.pad_value
        self._bounds: tuple[int, int] | None = None
        self._view: torch.Tensor | None = None

    def reset(self, raw: int, padded: int) -> None:
        if (raw, padded) != self._bounds:
            self._view = self.slot.span(raw, padded)
            self._bounds = (raw, padded)
        self._view.fill_(self.value)


def _copy_group(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    if dsts[0].is_cpu:
        for dst, src in zip(dsts, srcs, strict=True):
            dst.copy_(src)
    else:
        torch._foreach_copy_(dsts, srcs)


def _check_bind(
    slot: GraphSlot, bind: torch.Tensor, shape: tuple[int, ...], device: torch.device
) -> None:
    where = f"cannot bind a tensor to slot {slot.name!r}"
    if not isinstance(bind, torch.Tensor):
        raise TypeError(f"{where}: expected a torch.Tensor, got {type(bind).__name__}")
    if tuple(bind.shape) != shape:
        raise ValueError(f"{where}: shape {tuple(bind.shape)}, the slot declares {shape}")
    if bind.dtype != slot.dtype:
        raise TypeError(f"{where}: dtype {bind.dtype}, the slot declares {slot.dtype}")
    if bind.device != device:
        raise ValueError(f"{where}: device {bind.device}, the slot lives on {device}")


def _as_shape(shape: int | Sequence[int]) -> tuple[int, ...]:
    return (shape,) if isinstance(shape, int) else tuple(shape)
