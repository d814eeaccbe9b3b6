"""CPU tests of the declarative input-buffer registry (`bcg.graph.registry`).

Every test poisons the static buffers first (POISON) so that what a fill leaves in each
tail proves what the padding policy did. Tests on the meta device (no data) check which
ops a fill issues, as a GPU would launch them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bcg.graph.buffer_pool import clear_shared_buffers, share_buffer
from bcg.graph.registry import MAX_CACHED_PLANS, GraphBufferRegistry
from bcg.graph.slots import FillContext, GraphSlot, PaddingPolicy
from tests.numerics import POISON, poison, poison_registry

MAX_BS = 6
MAX_TOKENS = 8


@dataclass
class Batch:
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    mrope: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    note: str = "kept"


def tokens_shape(max_bs: int, max_tokens: int) -> tuple[int, ...]:
    return (max_tokens,)


def bs_shape(max_bs: int, max_tokens: int) -> tuple[int, ...]:
    return (max_bs,)


def token_slot(name: str = "input_ids", **kwargs) -> GraphSlot:
    return GraphSlot(name, tokens_shape, torch.int64, **kwargs)


def make_registry(*slots: GraphSlot, share_pool: bool = False) -> GraphBufferRegistry:
    registry = GraphBufferRegistry("cpu", MAX_BS, MAX_TOKENS, share_pool=share_pool)
    for slot in slots:
        registry.register_slot(slot)
    poison_registry(registry)
    return registry


def arange(n: int, start: int = 1) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64)


def fill(registry: GraphBufferRegistry, batch: Batch, raw: int, padded: int) -> None:
    """Fill with the same raw/padded counts on both axes (each slot uses one of them)."""
    registry.fill_from(
        batch, raw_bs=raw, padded_bs=padded, raw_num_tokens=raw, padded_num_tokens=padded
    )


def buffer_of(registry: GraphBufferRegistry, name: str = "input_ids") -> list:
    return registry.get_slot(name).buffer.tolist()


class AtenOps(TorchDispatchMode):
    """Records the aten ops run inside it, views included, as (name, args)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func.overloadpacket.__name__, args))
        return func(*args, **(kwargs or {}))

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def foreach_copies(self) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        return [(args[0], args[1]) for name, args in self.calls if name == "_foreach_copy_"]


def ops_of_fill(registry: GraphBufferRegistry, batch: Batch, raw: int, padded: int) -> AtenOps:
    with AtenOps() as ops:
        fill(registry, batch, raw=raw, padded=padded)
    return ops


def meta_ids(n: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype, device="meta")


@pytest.fixture(autouse=True)
def fresh_pool():
    clear_shared_buffers()
    yield
    clear_shared_buffers()


# --- padding policies: what each leaves in the tail [raw:padded] -------------------------


@pytest.mark.parametrize(
    "policy", [PaddingPolicy.FOREACH_COPY, PaddingPolicy.KEEP_PAD], ids=lambda p: p.name
)
def test_copy_policies_leave_tail_alone(policy):
    registry = make_registry(token_slot(padding_policy=policy))
    fill(registry, Batch(input_ids=arange(3)), raw=3, padded=6)
    assert buffer_of(registry) == [1, 2, 3] + [POISON] * 5


def test_default_policy_is_foreach_copy():
    assert token_slot().padding_policy is PaddingPolicy.FOREACH_COPY


def test_zero_resets_tail_only():
    registry = make_registry(token_slot(padding_policy=PaddingPolicy.ZERO))
    fill(registry, Batch(input_ids=arange(3)), raw=3, padded=6)
    assert buffer_of(registry) == [1, 2, 3, 0, 0, 0, POISON, POISON]


def test_fill_sentinel_resets_tail_to_pad_value():
    slot = token_slot(padding_policy=PaddingPolicy.FILL_SENTINEL, pad_value=-7)
    registry = make_registry(slot)
    fill(registry, Batch(input_ids=arange(2)), raw=2, padded=5)
    assert buffer_of(registry) == [1, 2, -7, -7, -7, POISON, POISON, POISON]


def test_fill_sentinel_on_bs_axis_uses_batch_counts():
    slot = GraphSlot(
        "seq_lens",
        bs_shape,
        torch.int32,
        axis="bs",
        padding_policy=PaddingPolicy.FILL_SENTINEL,
        pad_value=1,
    )
    registry = make_registry(slot)
    registry.fill_from(
        Batch(seq_lens=torch.tensor([5, 6], dtype=torch.int32)),
        raw_bs=2,
        padded_bs=3,
        raw_num_tokens=7,
        padded_num_tokens=8,
    )
    assert buffer_of(registry, "seq_lens") == [5, 6, 1] + [POISON] * (MAX_BS - 3)


def test_fill_once_fills_at_registration():
    slot = token_slot(padding_policy=PaddingPolicy.FILL_ONCE, pad_value=-1)
    registry = GraphBufferRegistry("cpu", MAX_BS, MAX_TOKENS)
    registered = registry.register_slot(slot)
    assert registered.buffer.tolist() == [-1] * MAX_TOKENS


def test_fill_once_is_never_reset():
    slot = token_slot(padding_policy=PaddingPolicy.FILL_ONCE, pad_value=-1)
    registry = make_registry(slot)
    fill(registry, Batch(input_ids=arange(2)), raw=2, padded=6)
    fill(registry, Batch(input_ids=arange(1, start=5)), raw=1, padded=6)
    assert buffer_of(registry) == [5, 2] + [POISON] * 6


def test_zero_resets_tail_again_on_every_fill():
    registry = make_registry(token_slot(padding_policy=PaddingPolicy.ZERO))
    fill(registry, Batch(input_ids=arange(5)), raw=5, padded=6)
    fill(registry, Batch(input_ids=arange(2, start=7)), raw=2, padded=6)
    assert buffer_of(registry) == [7, 8, 0, 0, 0, 0, POISON, POISON]


def test_no_padding_fill_touches_only_the_head():
    registry = make_registry(
        token_slot("input_ids", padding_policy=PaddingPolicy.ZERO),
        token_slot("positions", padding_policy=PaddingPolicy.FILL_SENTINEL, pad_value=-1),
    )
    fill(registry, Batch(input_ids=arange(4), positions=arange(4, start=10)), raw=4, padded=4)
    assert buffer_of(registry) == [1, 2, 3, 4] + [POISON] * 4
    assert buffer_of(registry, "positions") == [10, 11, 12, 13] + [POISON] * 4


# --- sources ------------------------------------------------------------------------------


def test_missing_and_none_fields_are_skipped():
    registry = make_registry(
        token_slot("input_ids"), token_slot("absent_field"), token_slot("positions")
    )
    fill(registry, Batch(input_ids=arange(2), positions=None), raw=2, padded=2)
    assert buffer_of(registry) == [1, 2] + [POISON] * 6
    assert buffer_of(registry, "absent_field") == [POISON] * MAX_TOKENS
    assert buffer_of(registry, "positions") == [POISON] * MAX_TOKENS


def test_skipped_source_still_gets_its_tail_reset():
    registry = make_registry(token_slot(padding_policy=PaddingPolicy.ZERO))
    fill(registry, Batch(), raw=2, padded=4)
    assert buffer_of(registry) == [POISON, POISON, 0, 0] + [POISON] * 4


def test_source_fn_replaces_the_field():
    slot = token_slot(source_fn=lambda batch: batch.positions * 2)
    registry = make_registry(slot)
    fill(registry, Batch(input_ids=arange(3, start=50), positions=arange(3)), raw=3, padded=3)
    assert buffer_of(registry) == [2, 4, 6] + [POISON] * 5


def test_source_fn_returning_none_skips_the_copy():
    registry = make_registry(token_slot(source_fn=lambda batch: None))
    fill(registry, Batch(input_ids=arange(3)), raw=3, padded=3)
    assert buffer_of(registry) == [POISON] * MAX_TOKENS


def test_head_follows_source_length_not_raw_count():
    slot = GraphSlot("cu_seqlens", lambda bs, tokens: (bs + 1,), torch.int32, axis="bs")
    registry = make_registry(slot)
    cu_seqlens = torch.tensor([0, 3, 5], dtype=torch.int32)
    fill(registry, Batch(cu_seqlens=cu_seqlens), raw=2, padded=3)
    assert buffer_of(registry, "cu_seqlens") == [0, 3, 5] + [POISON] * (MAX_BS - 2)


def test_mixed_dtypes_are_converted_into_the_buffer_dtype():
    registry = make_registry(
        token_slot("input_ids"),
        GraphSlot("seq_lens", tokens_shape, torch.int32),
        GraphSlot("positions", tokens_shape, torch.float32),
    )
    batch = Batch(
        input_ids=torch.tensor([1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([3, 4], dtype=torch.int64),
        positions=torch.tensor([5, 6], dtype=torch.int64),
    )
    fill(registry, batch, raw=2, padded=2)
    assert registry.get_slot("input_ids").buffer.dtype == torch.int64
    assert buffer_of(registry)[:3] == [1, 2, POISON]
    assert buffer_of(registry, "seq_lens")[:3] == [3, 4, POISON]
    assert buffer_of(registry, "positions")[:3] == [5.0, 6.0, float(POISON)]


def test_non_cpu_heads_take_one_foreach_copy_per_dtype_pair(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dsts, srcs: calls.append(len(dsts)))
    registry = GraphBufferRegistry("meta", MAX_BS, MAX_TOKENS)
    for name in ("input_ids", "positions", "seq_lens"):
        registry.register_slot(token_slot(name))
    registry.register_slot(GraphSlot("mrope", tokens_shape, torch.int32))
    batch = Batch(
        input_ids=torch.zeros(3, dtype=torch.int64, device="meta"),
        positions=torch.zeros(3, dtype=torch.int64, device="meta"),
        seq_lens=torch.zeros(3, dtype=torch.int32, device="meta"),
        mrope=torch.zeros(3, dtype=torch.int32, device="meta"),
    )
    fill(registry, batch, raw=3, padded=4)
    assert sorted(calls) == [1, 1, 2]  # (i64<-i64) x2, (i64<-i32), (i32<-i32)


def test_refill_with_another_length_uses_fresh_destination():
    registry = make_registry(token_slot())
    fill(registry, Batch(input_ids=arange(2)), raw=2, padded=2)
    fill(registry, Batch(input_ids=arange(5, start=20)), raw=5, padded=5)
    fill(registry, Batch(input_ids=arange(1, start=40)), raw=1, padded=1)
    assert buffer_of(registry) == [40, 21, 22, 23, 24, POISON, POISON, POISON]


def test_head_longer_than_raw_wins_over_its_reset_tail():
    # cu_seqlens has raw_bs + 1 entries: its last one lands in the bs tail [raw:padded].
    slot = GraphSlot(
        "cu_seqlens",
        lambda bs, tokens: (bs + 1,),
        torch.int32,
        axis="bs",
        padding_policy=PaddingPolicy.FILL_SENTINEL,
        pad_value=-1,
    )
    registry = make_registry(slot)
    cu_seqlens = torch.tensor([0, 3, 5], dtype=torch.int32)
    fill(registry, Batch(cu_seqlens=cu_seqlens), raw=2, padded=5)
    assert buffer_of(registry, "cu_seqlens") == [0, 3, 5, -1, -1, POISON, POISON]


def test_head_running_past_the_whole_tail_leaves_no_pad():
    slot = GraphSlot(
        "cu_seqlens",
        lambda bs, tokens: (bs + 1,),
        torch.int32,
        axis="bs",
        padding_policy=PaddingPolicy.ZERO,
    )
    registry = make_registry(slot)
    cu_seqlens = torch.tensor([0, 3, 5, 8], dtype=torch.int32)
    fill(registry, Batch(cu_seqlens=cu_seqlens), raw=3, padded=4)
    assert buffer_of(registry, "cu_seqlens") == [0, 3, 5, 8] + [POISON] * 3


def test_buffers_bound_over_shared_memory_reset_every_tail_before_the_copies():
    shared = poison(torch.empty(MAX_TOKENS + 2, dtype=torch.int64))
    registry = GraphBufferRegistry("cpu", MAX_BS, MAX_TOKENS)
    registry.register_slot(token_slot(padding_policy=PaddingPolicy.ZERO), bind=shared[:-2])
    registry.register_slot(token_slot("positions"), bind=shared[2:])
    # The input_ids tail [2:6] is shared[2:6]; the positions head writes shared[2:5] after.
    fill(registry, Batch(input_ids=arange(2), positions=arange(3, start=50)), raw=2, padded=6)
    assert shared.tolist() == [1, 2, 50, 51, 52, 0] + [POISON] * 4


def test_rejected_fill_writes_nothing():
    registry = make_registry(
        token_slot("positions", padding_policy=PaddingPolicy.ZERO), token_slot("input_ids")
    )
    batch = Batch(positions=arange(2), input_ids=arange(MAX_TOKENS + 1))
    with pytest.raises(ValueError, match="does not fit"):
        fill(registry, batch, raw=2, padded=4)
    assert buffer_of(registry, "positions") == [POISON] * MAX_TOKENS


def test_copy_from_batch_false_ignores_the_field():
    registry = make_registry(token_slot(copy_from_batch=False))
    fill(registry, Batch(input_ids=arange(3)), raw=3, padded=3)
    assert buffer_of(registry) == [POISON] * MAX_TOKENS


# --- grouped copies on a device (meta: no data, only the ops a fill issues) ---------------


def test_padded_fill_is_one_grouped_copy_per_dtype_group_tails_included():
    registry = GraphBufferRegistry("meta", MAX_BS, MAX_TOKENS)
    registry.register_slot(token_slot("input_ids"))
    registry.register_slot(token_slot("positions", padding_policy=PaddingPolicy.ZERO))
    registry.register_slot(
        GraphSlot(
            "seq_lens",
            tokens_shape,
            torch.int32,
            padding_policy=PaddingPolicy.FILL_SENTINEL,
            pad_value=1,
        )
    )
    registry.register_slot(
        GraphSlot("mrope", tokens_shape, torch.float32, padding_policy=PaddingPolicy.KEEP_PAD)
    )
    batch = Batch(
        input_ids=meta_ids(3),
        positions=meta_ids(3),
        seq_lens=meta_ids(3, torch.int32),
        mrope=meta_ids(3, torch.float32),
    )
    ops = ops_of_fill(registry, batch, raw=3, padded=5)
    assert "fill_" not in ops.names() and "copy_" not in ops.names()
    copies = ops.foreach_copies()
    assert sorted(len(dsts) for dsts, _ in copies) == [1, 2, 3]  # f32; i32 + tail; i64 x2 + tail
    for dsts, srcs in copies:
        assert [d.shape for d in dsts] == [s.shape for s in srcs]
        assert len({d.dtype for d in dsts}) == 1 and len({s.dtype for s in srcs}) == 1
    int64_dsts = next(dsts for dsts, _ in copies if len(dsts) == 3)
    tail = int64_dsts[-1]
    assert (tail.shape, tail.storage_offset()) == ((2,), 3)


def test_tail_a_head_overlaps_is_reset_on_its_own_before_the_copies():
    registry = GraphBufferRegistry("meta", MAX_BS, MAX_TOKENS)
    registry.register_slot(
        GraphSlot(
            "cu_seqlens",
            lambda bs, tokens: (bs + 1,),
            torch.int32,
            axis="bs",
            padding_policy=PaddingPolicy.ZERO,
        )
    )
    ops = ops_of_fill(registry, Batch(cu_seqlens=meta_ids(3, torch.int32)), raw=2, padded=4)
    assert [name for name in ops.names() if name in ("fill_", "_foreach_copy_")] == [
        "fill_",
        "_foreach_copy_",
    ]


def test_repeated_fill_reuses_its_plan_and_slices_nothing():
    registry = GraphBufferRegistry("meta", MAX_BS, MAX_TOKENS)
    registry.register_slot(token_slot("input_ids", padding_policy=PaddingPolicy.ZERO))
    registry.register_slot(token_slot("positions"))
    batch = Batch(input_ids=meta_ids(3), positions=meta_ids(3))
    first = ops_of_fill(registry, batch, raw=3, padded=5)
    again = ops_of_fill(registry, Batch(input_ids=meta_ids(3), positions=meta_ids(3)), 3, 5)
    assert {"as_strided", "slice"} <= set(first.names())
    assert again.names() == ["_foreach_copy_"]


def test_source_dtype_change_regroups_the_copies():
    registry = GraphBufferRegistry("meta", MAX_BS, MAX_TOKENS)
    registry.register_slot(token_slot("input_ids"))
    registry.register_slot(token_slot("positions"))
    same = Batch(input_ids=meta_ids(3), positions=meta_ids(3))
    mixed = Batch(input_ids=meta_ids(3), positions=meta_ids(3, torch.int32))
    assert len(ops_of_fill(registry, same, 3, 3).foreach_copies()) == 1
    copies = ops_of_fill(registry, mixed, 3, 3).foreach_copies()
    assert {srcs[0].dtype for _, srcs in copies} == {torch.int32, torch.int64}


def test_strided_destinations_get_their_own_grouped_copy():
    # A strided pair sends a whole _foreach_copy_ down its one-launch-per-pair path.
    registry = GraphBufferRegistry("meta", MAX_BS, MAX_TOKENS)
    registry.register_slot(token_slot("input_ids"))
    registry.register_slot(GraphSlot("mrope", lambda bs, tokens: (3, tokens), torch.int64))
    batch = Batch(input_ids=meta_ids(2), mrope=torch.zeros(3, 2, dtype=torch.int64, device="meta"))
    copies = ops_of_fill(registry, batch, 2, 2).foreach_copies()
    assert sorted((len(dsts), dsts[0].is_contiguous()) for dsts, _ in copies) == [
        (1, False),
        (1, True),
    ]


# --- fill plans ---------------------------------------------------------------------------


def test_plans_stay_bounded_and_correct_across_many_sizes():
    seen = []
    registry = make_registry(
        GraphSlot(
            "input_ids",
            lambda bs, tokens: (tokens,),
            torch.int64,
            padding_policy=PaddingPolicy.FILL_SENTINEL,
            pad_value=-1,
            post_fill=lambda view, batch, ctx: seen.append(ctx),
        )
    )
    sizes = [
        FillContext(bs, bs, raw, padded)
        for bs in range(1, MAX_BS + 1)
        for padded in range(1, MAX_TOKENS + 1)
        for raw in range(padded + 1)
    ]
    assert len(sizes) > MAX_CACHED_PLANS
    for ctx in sizes + sizes[:3]:
        poison_registry(registry)
        registry.fill_from(Batch(input_ids=arange(ctx.raw_num_tokens)), **dataclasses.asdict(ctx))
        pads = ctx.padded_num_tokens - ctx.raw_num_tokens
        untouched = MAX_TOKENS - ctx.padded_num_tokens
        assert buffer_of(registry) == [
            *range(1, ctx.raw_num_tokens + 1),
            *[-1] * pads,
            *[POISON] * untouched,
        ]
        assert seen[-1] == ctx
    assert len(registry._plans) <= MAX_CACHED_PLANS


def test_slot_registered_after_a_fill_takes_part_in_the_next_one():
    def ids_plus_one(view, batch, ctx):
        view[: ctx.raw_num_tokens] = batch.input_ids + 1

    registry = make_registry(token_slot("input_ids"))
    batch = Batch(input_ids=arange(2))
    fill(registry, batch, raw=2, padded=3)
    computed = token_slot(
        "positions",
        copy_from_batch=False,
        padding_policy=PaddingPolicy.ZERO,
        post_fill=ids_plus_one,
    )
    registry.register_slot(computed)
    poison_registry(registry)
    fill(registry, batch, raw=2, padded=3)  # same sizes and sources as the first fill
    assert buffer_of(registry, "positions") == [2, 3, 0] + [POISON] * 5


# --- post_fill hooks ----------------------------------------------------------------------


def test_post_fill_gets_padded_view_batch_and_context():
    seen = []
    slot = token_slot(post_fill=lambda view, batch, ctx: seen.append((view, batch, ctx)))
    registry = make_registry(slot)
    batch = Batch(input_ids=arange(3))
    registry.fill_from(batch, raw_bs=1, padded_bs=2, raw_num_tokens=3, padded_num_tokens=5)
    [(view, hook_batch, ctx)] = seen
    assert ctx == FillContext(raw_bs=1, padded_bs=2, raw_num_tokens=3, padded_num_tokens=5)
    assert hook_batch is batch
    assert view.shape == (5,)
    assert view.data_ptr() == registry.get_slot("input_ids").buffer.data_ptr()


def test_post_fill_runs_after_every_copy_and_reset():
    def positions_from_ids(view, batch, ctx):
        ids = registry.get_slot("input_ids").buffer
        view.copy_(ids[: ctx.padded_num_tokens] * 10)

    registry = make_registry(
        token_slot("positions", copy_from_batch=False, post_fill=positions_from_ids),
        token_slot("input_ids", padding_policy=PaddingPolicy.ZERO),
    )
    fill(registry, Batch(input_ids=arange(2)), raw=2, padded=4)
    assert buffer_of(registry, "positions") == [10, 20, 0, 0] + [POISON] * 4


def test_post_fill_adjusts_a_copied_slot():
    def shift(view, batch, ctx):
        view[: ctx.raw_num_tokens] += 100

    registry = make_registry(token_slot(post_fill=shift))
    fill(registry, Batch(input_ids=arange(2)), raw=2, padded=3)
    assert buffer_of(registry) == [101, 102] + [POISON] * 6


# --- slice_fn -----------------------------------------------------------------------------


def mrope_slot(**kwargs) -> GraphSlot:
    return GraphSlot(
        "mrope",
        lambda bs, tokens: (3, tokens),
        torch.int64,
        slice_fn=lambda buffer, start, stop: buffer[:, start:stop],
        **kwargs,
    )


def test_slice_fn_slices_along_token_axis():
    registry = make_registry(mrope_slot())
    assert registry.get_slot("mrope").slice_for(padded_bs=1, padded_num_tokens=5).shape == (3, 5)


def test_slice_fn_resets_tail_along_token_axis():
    registry = make_registry(mrope_slot(padding_policy=PaddingPolicy.ZERO))
    source = torch.arange(6, dtype=torch.int64).view(3, 2)
    fill(registry, Batch(mrope=source), raw=2, padded=4)
    expected_row_tail = [0, 0] + [POISON] * 4
    assert buffer_of(registry, "mrope") == [
        [0, 1] + expected_row_tail,
        [2, 3] + expected_row_tail,
        [4, 5] + expected_row_tail,
    ]


# --- slicing and extract_buffer -----------------------------------------------------------


def test_slice_for_by_axis():
    registry = make_registry(
        token_slot("input_ids"),
        GraphSlot("seq_lens", bs_shape, torch.int32, axis="bs"),
        GraphSlot("note_table", lambda bs, tokens: (2, 2), torch.int32, axis="none"),
    )
    sizes = dict(padded_bs=3, padded_num_tokens=6)
    assert registry.get_slot("input_ids").slice_for(**sizes).shape == (6,)
    assert registry.get_slot("seq_lens").slice_for(**sizes).shape == (3,)
    assert registry.get_slot("note_table").slice_for(**sizes).shape == (2, 2)


def test_extract_buffer_views_share_storage_and_keep_other_fields():
    registry = make_registry(token_slot("input_ids"), token_slot("positions"))
    template = Batch(input_ids=arange(3), positions=arange(3), note="mine")
    out = registry.extract_buffer(padded_bs=2, padded_num_tokens=5, template=template)
    assert out.note == "mine"
    assert out.input_ids.shape == (5,)
    assert out.input_ids.data_ptr() == registry.get_slot("input_ids").buffer.data_ptr()
    out.positions.fill_(7)
    assert buffer_of(registry, "positions") == [7] * 5 + [POISON] * 3


def test_extract_buffer_leaves_template_untouched():
    template = Batch(input_ids=arange(3))
    registry = make_registry(token_slot("input_ids"))
    out = registry.extract_buffer(padded_bs=1, padded_num_tokens=4, template=template)
    assert out is not template
    assert template.input_ids.tolist() == [1, 2, 3]


def test_extract_buffer_keeps_none_for_plain_slots_and_exposes_computed():
    registry = make_registry(
        token_slot("input_ids"),
        token_slot("positions", copy_from_batch=False),
        token_slot("seq_lens", post_fill=lambda view, batch, ctx: None),
    )
    out = registry.extract_buffer(padded_bs=1, padded_num_tokens=4, template=Batch())
    assert out.input_ids is None
    assert out.positions.shape == (4,)
    assert out.seq_lens.shape == (4,)


def test_fill_then_extract_reads_what_was_filled():
    registry = make_registry(token_slot(padding_policy=PaddingPolicy.ZERO))
    batch = Batch(input_ids=arange(3))
    fill(registry, batch, raw=3, padded=4)
    out = registry.extract_buffer(padded_bs=1, padded_num_tokens=4, template=batch)
    assert out.input_ids.tolist() == [1, 2, 3, 0]


# --- registration -------------------------------------------------------------------------


def test_disabled_slots_are_never_allocated_or_listed():
    registry = make_registry(token_slot("input_ids"))
    assert registry.register_slot(token_slot("positions", enabled=False)) is None
    assert registry.slot_names() == ["input_ids"]
    assert registry.has_slot("input_ids") and not registry.has_slot("positions")
    with pytest.raises(KeyError, match="positions"):
        registry.get_slot("positions")


def test_register_returns_a_copy_and_leaves_the_declaration_reusable():
    declaration = token_slot()
    first = make_registry(declaration)
    second = make_registry(declaration)
    assert declaration.buffer is None
    assert first.get_slot("input_ids") is not declaration
    a, b = first.get_slot("input_ids").buffer, second.get_slot("input_ids").buffer
    assert a.data_ptr() != b.data_ptr()


def test_bind_adopts_an_existing_tensor():
    existing = poison(torch.empty(MAX_TOKENS, dtype=torch.int64))
    registry = GraphBufferRegistry("cpu", MAX_BS, MAX_TOKENS)
    registry.register_slot(token_slot(padding_policy=PaddingPolicy.ZERO), bind=existing)
    fill(registry, Batch(input_ids=arange(2)), raw=2, padded=3)
    assert registry.get_slot("input_ids").buffer is existing
    assert existing.tolist() == [1, 2, 0] + [POISON] * 5


def test_slot_device_overrides_registry_device():
    registry = GraphBufferRegistry("cpu", MAX_BS, MAX_TOKENS)
    registered = registry.register_slot(token_slot(device="meta"))
    assert registered.buffer.device.type == "meta"


def test_shape_fn_may_return_an_int():
    registry = make_registry(GraphSlot("seq_lens", lambda bs, tokens: bs * 2, torch.int32))
    assert registry.get_slot("seq_lens").buffer.shape == (MAX_BS * 2,)


def test_fresh_buffers_start_at_zero():
    registry = GraphBufferRegistry("cpu", MAX_BS, MAX_TOKENS)
    assert registry.register_slot(token_slot()).buffer.tolist() == [0] * MAX_TOKENS


# --- shared pool --------------------------------------------------------------------------


def test_pool_shares_identical_requests_whatever_the_order():
    first = GraphBufferRegistry("cpu", MAX_BS, MAX_TOKENS, share_pool=True)
    first.register_slot(token_slot("input_ids"))
    first.register_slot(token_slot("positions"))
    second = GraphBufferRegistry("cpu", MAX_BS, MAX_TOKENS, share_pool=True)
    second.register_slot(token_slot("positions"))
    second.register_slot(token_slot("input_ids"))
    for name in ("input_ids", "positions"):
        a, b = first.get_slot(name).buffer, second.get_slot(name).buffer
        assert a.data_ptr() == b.data_ptr()
    poison_registry(first)
    fill(second, Batch(input_ids=arange(2)), raw=2, padded=2)
    assert buffer_of(first) == [1, 2] + [POISON] * 6


def test_pool_never_aliases_different_sizes_or_names():
    small = make_registry(token_slot(), share_pool=True)
    big = GraphBufferRegistry("cpu", MAX_BS, MAX_TOKENS * 2, share_pool=True)
    big.register_slot(token_slot())
    big.register_slot(token_slot("positions"))
    poison_registry(big)
    fill(small, Batch(input_ids=arange(3)), raw=3, padded=3)
    assert buffer_of(big) == [POISON] * MAX_TOKENS * 2
    assert buffer_of(big, "positions") == [POISON] * MAX_TOKENS * 2


def test_pool_keys_on_numel_so_shapes_may_differ():
    flat = share_buffer("table", (6,), torch.int32, "cpu")
    square = share_buffer("table", (2, 3), torch.int32, "cpu")
    other_dtype = share_buffer("table", (6,), torch.int64, "cpu")
    assert square.shape == (2, 3)
    assert flat.data_ptr() == square.data_ptr()
    assert other_dtype.data_ptr() != flat.data_ptr()


def test_without_share_pool_registries_are_independent():
    first = make_registry(token_slot())
    second = make_registry(token_slot())
    fill(second, Batch(input_ids=arange(2)), raw=2, padded=2)
    assert buffer_of(first) == [POISON] * MAX_TOKENS


# --- errors -------------------------------------------------------------------------------


def test_bad_axis_is_rejected():
    with pytest.raises(ValueError, match="axis must be one of"):
        token_slot(axis="rows")


@pytest.mark.parametrize(
    "policy", [PaddingPolicy.FILL_SENTINEL, PaddingPolicy.FILL_ONCE], ids=lambda p: p.name
)
def test_pad_value_policies_need_a_pad_value(policy):
    with pytest.raises(ValueError, match="needs a pad_value"):
        token_slot(padding_policy=policy)


def test_pad_value_without_a_padding_policy_is_rejected():
    with pytest.raises(ValueError, match="ignores pad_value"):
        token_slot(padding_policy=PaddingPolicy.ZERO, pad_value=5)


def test_reset_policy_on_axis_none_is_rejected():
    with pytest.raises(ValueError, match="no padded tail"):
        token_slot(axis="none", padding_policy=PaddingPolicy.ZERO)


def test_source_fn_with_copy_from_batch_false_is_rejected():
    with pytest.raises(ValueError, match="source_fn is unused"):
        token_slot(copy_from_batch=False, source_fn=lambda batch: None)


def test_slicing_before_allocation_is_rejected():
    with pytest.raises(RuntimeError, match="no buffer yet"):
        token_slot().slice_for(padded_bs=1, padded_num_tokens=2)


def test_duplicate_name_is_rejected():
    registry = make_registry(token_slot())
    with pytest.raises(ValueError, match="already registered"):
        registry.register_slot(token_slot())


def test_bind_shape_mismatch_is_rejected():
    registry = GraphBufferRegistry("cpu", MAX_BS, MAX_TOKENS)
    with pytest.raises(ValueError, match="shape"):
        registry.register_slot(token_slot(), bind=torch.zeros(MAX_TOKENS + 1, dtype=torch.int64))


def test_bind_dtype_mismatch_is_rejected():
    registry = GraphBufferRegistry("cpu", MAX_BS, MAX_TOKENS)
    with pytest.raises(TypeError, match="dtype"):
        registry.register_slot(token_slot(), bind=torch.zeros(MAX_TOKENS, dtype=torch.int32))


def test_bind_device_mismatch_is_rejected():
    registry = GraphBufferRegistry("cpu", MAX_BS, MAX_TOKENS)
    bind = torch.zeros(MAX_TOKENS, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="device"):
        registry.register_slot(token_slot(), bind=bind)


def test_policy_must_be_a_padding_policy():
    with pytest.raises(TypeError, match="PaddingPolicy"):
        token_slot(padding_policy="zero")


def test_source_longer_than_buffer_is_rejected():
    registry = make_registry(token_slot())
    with pytest.raises(ValueError, match="does not fit"):
        fill(registry, Batch(input_ids=arange(MAX_TOKENS + 1)), raw=2, padded=2)


def test_source_with_wrong_dims_is_rejected():
    registry = make_registry(token_slot())
    with pytest.raises(ValueError, match="does not fit"):
        fill(registry, Batch(input_ids=arange(4).view(2, 2)), raw=2, padded=2)


def test_non_tensor_source_is_rejected():
    registry = make_registry(token_slot())
    with pytest.raises(TypeError, match="not a tensor"):
        fill(registry, Batch(input_ids=[1, 2]), raw=2, padded=2)


@pytest.mark.parametrize(
    "raw, padded", [(3, 2), (1, MAX_TOKENS + 1), (-1, 2)], ids=["raw>padded", "over-max", "neg"]
)
def test_fill_sizes_out_of_range_are_rejected(raw, padded):
    registry = make_registry(token_slot())
    with pytest.raises(ValueError, match="raw <= padded <= max"):
        fill(registry, Batch(input_ids=arange(1)), raw=raw, padded=padded)


def test_extract_buffer_needs_a_dataclass_with_the_computed_fields():
    registry = make_registry(token_slot("not_a_field", copy_from_batch=False))
    with pytest.raises(TypeError, match="dataclass instance"):
        registry.extract_buffer(padded_bs=1, padded_num_tokens=2, template=object())
    with pytest.raises(TypeError, match="not_a_field"):
        registry.extract_buffer(padded_bs=1, padded_num_tokens=2, template=Batch())
