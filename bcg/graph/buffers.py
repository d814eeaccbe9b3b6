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
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

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
# Fill plans kept per registry; a plan holds a few views per slot, so this bounds memory.
MAX_CACHED_PLANS = 64
# Pad-source views kept per reset slot, one per tail layout (shape and strides).
MAX_CACHED_PAD_VIEWS = 1024
# A source's shape and dtype: what a cached fill plan depends on.
_source_signature = operator.attrgetter("shape", "dtype")
# A destination buffer's (device, dtype, is_cpu).
_CopyKind = tuple[torch.device, torch.dtype, bool]


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
    Each ZERO / FILL_SENTINEL slot also keeps a private pad source, a constant tensor laid
    out like its buffer, so its tail is reset by the same grouped copy as the heads.
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
        # What fill_from walks, set at registration: how to fetch each copied slot's
        # source and land it in the buffer, the tails to reset per axis, the hooked slots.
        self._sources: list[tuple[str, SourceFn | None]] = []
        self._heads: list[_Head] = []
        self._bs_resets: list[_Reset] = []
        self._token_resets: list[_Reset] = []
        self._hooked: list[GraphSlot] = []
        # Buffers bound over shared memory let one slot's tail meet another slot's head,
        # and one grouped copy has no order: then every tail is reset first, on its own.
        self._aliased = False
        # Fill plans by sizes and source shapes and dtypes, least recently used first.
        self._plans: OrderedDict[tuple, _FillPlan] = OrderedDict()

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
        self._aliased = self._aliased or any(
            _share_memory(slot.buffer, other.buffer) for other in self._slots.values()
        )
        self._slots[slot.name] = slot
        self._enlist(slot)
        self._plans.clear()  # a plan covers the slots registered when it was built
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
        """Copy `batch` into the static buffers for a graph of the padded sizes, in three
        phases: reset the tails the policies ask for, copy every head, then run the
        `post_fill` hooks in registration order. A tail that no head overlaps is reset by
        copying its pad source in the same grouped copy as the heads, so a fill issues one
        copy per dtype pair on a GPU; what it slices is cached per sizes and shapes."""
        sources = [
            getattr(batch, name, None) if source_fn is None else source_fn(batch)
            for name, source_fn in self._sources
        ]
        plan = self._plan_for((raw_bs, padded_bs, raw_num_tokens, padded_num_tokens), sources)
        for tail, value in plan.lone_resets:
            tail.fill_(value)
        for group in plan.copies:
            srcs = [sources[index] for index in group.source_indices] + group.pads
            _copy_group(group.dsts, srcs, group.on_cpu)
        for slot, view in plan.hooks:
            slot.post_fill(view, batch, plan.ctx)

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

    def _enlist(self, slot: GraphSlot) -> None:
        if slot.copy_from_batch:
            self._sources.append((slot.name, slot.source_fn))
            self._heads.append(_Head(slot))
        if slot.padding_policy in _RESET_POLICIES:
            resets = self._bs_resets if slot.axis == "bs" else self._token_resets
            resets.append(_Reset(slot))
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

    def _plan_for(self, sizes: tuple[int, int, int, int], sources: list) -> _FillPlan:
        """The plan for these sizes and these sources' shapes and dtypes: cached, since a
        runner mostly repeats a few shapes and slicing costs host time on every fill."""
        try:
            key = (*sizes, *[None if src is None else _source_signature(src) for src in sources])
        except AttributeError:  # a source that is not a tensor: building the plan says so
            return self._build_plan(sizes, sources)
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        plan = self._plans[key] = self._build_plan(sizes, sources)
        if len(self._plans) > MAX_CACHED_PLANS:
            self._plans.popitem(last=False)
        return plan

    def _build_plan(self, sizes: tuple[int, int, int, int], sources: list) -> _FillPlan:
        """Check the sizes and sources, then slice every view one fill writes or reads."""
        self._check_sizes(*sizes)
        raw_bs, padded_bs, raw_num_tokens, padded_num_tokens = sizes
        groups: dict[tuple, _CopyGroup] = {}
        landed: dict[str, tuple[torch.Size, torch.Tensor]] = {}  # name: (source shape, view)
        for index, (head, src) in enumerate(zip(self._heads, sources, strict=True)):
            if src is not None:
                view = head.view_for(src)
                landed[head.slot.name] = (src.shape, view)
                group = _group_for(groups, head.kind, src.dtype, view)
                group.dsts.append(view)
                group.source_indices.append(index)
        # Every head is grouped before any tail: a group lists its head copies first.
        lone_resets = []
        for resets, raw, padded in (
            (self._bs_resets, raw_bs, padded_bs),
            (self._token_resets, raw_num_tokens, padded_num_tokens),
        ):
            for reset in resets if raw < padded else ():
                slot = reset.slot
                tail = slot.span(raw, padded)
                # A head may run past `raw` (e.g. cu_seqlens, raw_bs + 1 entries); where it
                # meets the tail it must win, so that tail is reset before the copies.
                if self._aliased or _head_meets_tail(slot, landed.get(slot.name), tail, raw):
                    lone_resets.append((tail, reset.value))
                else:
                    group = _group_for(groups, reset.kind, slot.dtype, tail)
                    group.dsts.append(tail)
                    group.pads.append(reset.pad_view(tail, raw, padded))
        hooks = [(slot, slot.slice_for(padded_bs, padded_num_tokens)) for slot in self._hooked]
        return _FillPlan(lone_resets, list(groups.values()), hooks, FillContext(*sizes))


class _Head:
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


class _Reset:
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


class _CopyGroup(NamedTuple):
    """Copies issued by one call: `dsts` are the head views (sourced from the fill's
    sources at `source_indices`, in order) followed by the tail views (sourced from
    `pads`, their twin views of the pad sources)."""

    dsts: list[torch.Tensor]
    source_indices: list[int]
    pads: list[torch.Tensor]
    on_cpu: bool


class _FillPlan(NamedTuple):
    """Everything one fill does for given sizes and source shapes, with its views sliced."""

    lone_resets: list[tuple[torch.Tensor, int | float | bool]]  # tails a head may overlap
    copies: list[_CopyGroup]
    hooks: list[tuple[GraphSlot, torch.Tensor]]
    ctx: FillContext


def _copy_kind(slot: GraphSlot) -> _CopyKind:
    """What every copy into the slot's buffer shares: its device and dtype (and whether
    that device is the CPU, asked here once rather than on every plan)."""
    buffer = slot.buffer
    return (buffer.device, buffer.dtype, buffer.is_cpu)


def _group_for(
    groups: dict[tuple, _CopyGroup],
    kind: _CopyKind,
    src_dtype: torch.dtype,
    dst: torch.Tensor,
) -> _CopyGroup:
    # torch._foreach_copy_ takes one (dst, src) dtype pair per call, and copies a whole call
    # in one launch only if every pair is dense with equal strides; a single strided view
    # (e.g. a partly filled 2-D buffer) makes it copy pair by pair, so those go apart.
    key = (kind, src_dtype, dst.is_contiguous())
    group = groups.get(key)
    if group is None:
        group = groups[key] = _CopyGroup([], [], [], kind[2])
    return group


def _copy_group(dsts: list[torch.Tensor], srcs: list[torch.Tensor], on_cpu: bool) -> None:
    if on_cpu:
        # In list order: head copies first, so a tail wrongly grouped with the head it
        # overlaps would clobber it here and fail the CPU tests.
        for dst, src in zip(dsts, srcs, strict=True):
            dst.copy_(src)
    else:
        torch._foreach_copy_(dsts, srcs)


def _head_meets_tail(
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
    return _ranges_meet(_element_range(head), _element_range(tail))


def _pad_source(buffer: torch.Tensor, value: int | float | bool) -> torch.Tensor:
    """A constant tensor with `buffer`'s shape and strides holding `value`: any tail view
    of the buffer has a twin view here, as long and laid out alike, to copy from."""
    pad = torch.empty_strided(
        buffer.shape, buffer.stride(), dtype=buffer.dtype, device=buffer.device
    )
    return pad.fill_(value)


def _element_range(tensor: torch.Tensor) -> tuple[int, int]:
    """The storage elements `[first, last + 1)` a tensor spans; empty if it has none."""
    if tensor.numel() == 0:
        return (0, 0)
    first = tensor.storage_offset()
    last = first + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return first, last + 1


def _ranges_meet(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < a[1] and b[0] < b[1] and a[0] < b[1] and b[0] < a[1]


def _share_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two buffers may share bytes (meta tensors have no memory to share)."""
    if a.device != b.device or a.device.type == "meta":
        return False
    (a_first, a_stop), (b_first, b_stop) = _element_range(a), _element_range(b)
    a_bytes = (a.data_ptr(), a.data_ptr() + (a_stop - a_first) * a.element_size())
    b_bytes = (b.data_ptr(), b.data_ptr() + (b_stop - b_first) * b.element_size())
    return _ranges_meet(a_bytes, b_bytes)


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
