"""`GraphBufferRegistry`: allocates (or binds, or shares) each `GraphSlot`'s buffer once
and fills them all from a live batch by a cached fill plan, the same way for every runner."""

from __future__ import annotations

import dataclasses
import operator
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

import bcg.graph.fill_plan as fill_plan
from bcg.graph.buffer_pool import normalize_device, share_buffer
from bcg.graph.fill_plan import FillPlan, Head, Reset, copy_group
from bcg.graph.slots import RESET_POLICIES, FillContext, GraphSlot, PaddingPolicy, SourceFn

# Fill plans kept per registry; a plan holds a few views per slot, so this bounds memory.
MAX_CACHED_PLANS = 64
# A source's shape and dtype: what a cached fill plan depends on.
_source_signature = operator.attrgetter("shape", "dtype")


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
        self._heads: list[Head] = []
        self._bs_resets: list[Reset] = []
        self._token_resets: list[Reset] = []
        self._hooked: list[GraphSlot] = []
        # Buffers bound over shared memory let one slot's tail meet another slot's head,
        # and one grouped copy has no order: then every tail is reset first, on its own.
        self._aliased = False
        # Fill plans by sizes and source shapes and dtypes, least recently used first.
        self._plans: OrderedDict[tuple, FillPlan] = OrderedDict()

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
            copy_group(group.dsts, srcs, group.on_cpu)
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
            self._heads.append(Head(slot))
        if slot.padding_policy in RESET_POLICIES:
            resets = self._bs_resets if slot.axis == "bs" else self._token_resets
            resets.append(Reset(slot))
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

    def _plan_for(self, sizes: tuple[int, int, int, int], sources: list) -> FillPlan:
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

    def _build_plan(self, sizes: tuple[int, int, int, int], sources: list) -> FillPlan:
        """Check the sizes and sources, then slice every view one fill writes or reads."""
        self._check_sizes(*sizes)
        raw_bs, padded_bs, raw_num_tokens, padded_num_tokens = sizes
        groups: dict[tuple, fill_plan.CopyGroup] = {}
        landed: dict[str, tuple[torch.Size, torch.Tensor]] = {}  # name: (source shape, view)
        for index, (head, src) in enumerate(zip(self._heads, sources, strict=True)):
            if src is not None:
                view = head.view_for(src)
                landed[head.slot.name] = (src.shape, view)
                group = fill_plan.group_for(groups, head.kind, src.dtype, view)
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
                head = landed.get(slot.name)
                if self._aliased or fill_plan.head_meets_tail(slot, head, tail, raw):
                    lone_resets.append((tail, reset.value))
                else:
                    group = fill_plan.group_for(groups, reset.kind, slot.dtype, tail)
                    group.dsts.append(tail)
                    group.pads.append(reset.pad_view(tail, raw, padded))
        hooks = [(slot, slot.slice_for(padded_bs, padded_num_tokens)) for slot in self._hooked]
        return FillPlan(lone_resets, list(groups.values()), hooks, FillContext(*sizes))


def _share_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two buffers may share bytes (meta tensors have no memory to share)."""
    if a.device != b.device or a.device.type == "meta":
        return False
    (a_first, a_stop), (b_first, b_stop) = fill_plan.element_range(a), fill_plan.element_range(b)
    a_bytes = (a.data_ptr(), a.data_ptr() + (a_stop - a_first) * a.element_size())
    b_bytes = (b.data_ptr(), b.data_ptr() + (b_stop - b_first) * b.element_size())
    return fill_plan.ranges_meet(a_bytes, b_bytes)


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
