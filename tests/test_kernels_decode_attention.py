"""Paged decode attention (Triton) against the PyTorch reference, incl. CUDA graph replay."""

from __future__ import annotations

import pytest
import torch

from tests.kernels_support import (
    DEVICE,
    HEAD_SHAPES,
    ON_GPU,
    TOLERANCE,
    PagedBatch,
    import_kernels,
    make_paged_batch,
    record_launches,
    reference_attention,
)
from tests.numerics import POISON, poison, poisoned_like, relative_error

decode = import_kernels("decode_attention")

MAX_LEN = 3000 if ON_GPU else 70
MAX_BATCH = 24 if ON_GPU else 5


def random_lengths(batch: int, generator: torch.Generator) -> list[int]:
    """Lengths in [1, MAX_LEN], always including 1 and one that is no multiple of 16."""
    lengths = torch.randint(1, MAX_LEN + 1, (batch,), generator=generator).tolist()
    lengths[0] = 1
    if batch > 1:
        lengths[1] = 16 * (MAX_LEN // 32) + 5
    return lengths


def decode_batch(
    lengths: list[int], head_shape: tuple, generator: torch.Generator, **kwargs
) -> PagedBatch:
    """One new token per row; a row of length 0 is padding."""
    return make_paged_batch([1] * len(lengths), lengths, *head_shape, generator, **kwargs)


def run_decode(batch: PagedBatch, **kwargs) -> torch.Tensor:
    return decode.decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.seq_lens, batch.block_tables, batch.scale,
        **kwargs,
    )


def assert_matches(out: torch.Tensor, batch: PagedBatch) -> None:
    """Live rows match the reference; padded rows were not written."""
    expected = reference_attention(batch)
    live = batch.seq_lens > 0
    assert relative_error(out[live], expected[live]) <= TOLERANCE
    assert (out[~live] == POISON).all()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("head_shape", HEAD_SHAPES, ids=str)
def test_decode_matches_reference(head_shape: tuple, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    batch_size = int(torch.randint(1, MAX_BATCH + 1, (1,), generator=generator))
    batch = decode_batch(random_lengths(batch_size, generator), head_shape, generator)
    assert_matches(run_decode(batch, out=poisoned_like(batch.q)), batch)


@pytest.mark.parametrize("num_splits", [1, 3, 64])
def test_decode_split_counts_agree(num_splits: int) -> None:
    """One split writes the output directly; many splits leave some chunks empty."""
    generator = torch.Generator().manual_seed(num_splits)
    head_shape = HEAD_SHAPES[1]
    batch = decode_batch(random_lengths(3, generator), head_shape, generator)
    plan = decode.plan_decode(3, *head_shape[:3], DEVICE, num_splits=num_splits)
    assert_matches(run_decode(batch, out=poisoned_like(batch.q), plan=plan), batch)


@pytest.mark.parametrize("splits_per_load", [1, 2])
def test_the_merge_loads_a_few_splits_at_a_time(monkeypatch: pytest.MonkeyPatch,
                                                splits_per_load: int) -> None:
    """Splits merged in loads of one or two (three in use: a partial last load), a group of
    three heads (a padded head row)."""
    head_shape = HEAD_SHAPES[2]
    monkeypatch.setattr(decode, "MERGE_LOAD_VALUES", splits_per_load * 4 * head_shape[2])
    generator = torch.Generator().manual_seed(17)
    plan = decode.plan_decode(3, *head_shape[:3], DEVICE, num_splits=64)
    batch = decode_batch(random_lengths(3, generator), head_shape, generator)
    assert_matches(run_decode(batch, out=poisoned_like(batch.q), plan=plan), batch)
    assert not plan.arrivals.any()


@pytest.mark.parametrize("num_splits", [0, 65])
def test_split_counts_past_the_merge_are_refused(num_splits: int) -> None:
    with pytest.raises(ValueError, match="num_splits"):
        decode.plan_decode(1, *HEAD_SHAPES[1][:3], DEVICE, num_splits=num_splits)


def test_more_rows_than_the_grid_holds_are_refused() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        decode.plan_decode(decode.MAX_GRID_ROWS + 1, *HEAD_SHAPES[1][:3], DEVICE)
    # the engine's cap on a step's sequences is the grid's
    from bcg.config import MAX_NUM_SEQS

    assert MAX_NUM_SEQS == decode.MAX_GRID_ROWS


def test_split_counts_share_one_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan's split count follows its batch size (one split for large batches); each call
    is one launch (the last split merges), with the same constexprs whatever the count."""
    split_launches = record_launches(monkeypatch, decode, "_launch_split")
    generator = torch.Generator().manual_seed(11)
    head_shape = HEAD_SHAPES[1]
    for batch_size, num_splits in ((8, 1), (3, 2), (1, 5)):
        batch = decode_batch(random_lengths(batch_size, generator), head_shape, generator)
        plan = decode.plan_decode(batch_size, *head_shape[:3], DEVICE, num_splits=num_splits)
        assert_matches(run_decode(batch, out=poisoned_like(batch.q), plan=plan), batch)
    assert len(split_launches) == 3
    assert split_launches[0] == split_launches[1] == split_launches[2]


def test_a_plan_serves_call_after_call() -> None:
    """Every layer of a step (and every replay) reuses one plan: the merging split leaves
    the arrival counts at zero, so the next call merges again, right."""
    generator = torch.Generator().manual_seed(13)
    head_shape = HEAD_SHAPES[1]
    plan = decode.plan_decode(4, *head_shape[:3], DEVICE, num_splits=4)
    for _ in range(3):
        batch = decode_batch(random_lengths(4, generator), head_shape, generator)
        assert_matches(run_decode(batch, out=poisoned_like(batch.q), plan=plan), batch)
        assert not plan.arrivals.any()


def test_padded_rows_are_untouched() -> None:
    generator = torch.Generator().manual_seed(7)
    batch = decode_batch([0, 5, 0, MAX_LEN, 1, 0], HEAD_SHAPES[2], generator)
    assert_matches(run_decode(batch, out=poisoned_like(batch.q)), batch)


def test_plan_serves_smaller_batches() -> None:
    generator = torch.Generator().manual_seed(3)
    plan = decode.plan_decode(MAX_BATCH + 3, *HEAD_SHAPES[1][:3], DEVICE)
    batch = decode_batch(random_lengths(MAX_BATCH, generator), HEAD_SHAPES[1], generator)
    assert_matches(run_decode(batch, out=poisoned_like(batch.q), plan=plan), batch)


def test_mismatched_plan_is_refused() -> None:
    batch = decode_batch([4, 9], HEAD_SHAPES[1], torch.Generator().manual_seed(0))
    plan = decode.plan_decode(1, *HEAD_SHAPES[1][:3], DEVICE)
    with pytest.raises(ValueError, match="plan_decode"):
        run_decode(batch, plan=plan)


def strided_last_dim(t: torch.Tensor) -> torch.Tensor:
    """The same values with the last two dimensions' strides swapped."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


@pytest.mark.parametrize("argument,bad_value,message", [
    ("q", lambda b: strided_last_dim(b.q), "q must have a contiguous last dimension"),
    ("q", lambda b: b.q[..., :32], "does not fit the cache"),
    ("v_cache", lambda b: b.v_cache[1:], "same shape and strides"),
    ("out", lambda b: strided_last_dim(torch.empty_like(b.q)), "out needs a contiguous"),
], ids=["q strides", "q head_dim", "v_cache shape", "out strides"])
def test_bad_arguments_are_refused(argument: str, bad_value, message: str) -> None:
    """The checks decode and extend attention share (``paged_attention_layout``)."""
    batch = decode_batch([4, 9], HEAD_SHAPES[1], torch.Generator().manual_seed(0))
    args = {"q": batch.q, "k_cache": batch.k_cache, "v_cache": batch.v_cache, "out": None}
    args[argument] = bad_value(batch)
    with pytest.raises(ValueError, match=message):
        decode.decode_attention(
            args["q"], args["k_cache"], args["v_cache"], batch.seq_lens, batch.block_tables,
            batch.scale, out=args["out"],
        )


@pytest.mark.gpu
def test_graph_replay_with_new_lengths_and_tables() -> None:
    """Capture once, then replay with other lengths, tables, contents and padded rows."""
    generator = torch.Generator().manual_seed(11)
    head_shape, rows = HEAD_SHAPES[4], 8
    max_blocks = -(-MAX_LEN // head_shape[3])

    def fresh_batch(padded_row: int) -> PagedBatch:
        lengths = random_lengths(rows, generator)
        lengths[padded_row] = 0
        return decode_batch(lengths, head_shape, generator, max_blocks=max_blocks)

    static = fresh_batch(padded_row=rows - 1)
    static_out = torch.empty_like(static.q)
    plan = decode.plan_decode(rows, *head_shape[:3], DEVICE)
    run_decode(static, out=static_out, plan=plan)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_decode(static, out=static_out, plan=plan)

    for replay in range(3):
        fresh = fresh_batch(padded_row=replay)
        for name in ("q", "k_cache", "v_cache", "seq_lens", "block_tables"):
            getattr(static, name).copy_(getattr(fresh, name))
        poison(static_out)
        graph.replay()
        assert_matches(static_out, static)


@pytest.mark.gpu
def test_repeated_calls_take_the_fast_launch_path() -> None:
    """Same shapes, new tensors: no launch goes back through JITFunction.run, and the
    cached kernels still compute the right thing."""
    generator = torch.Generator().manual_seed(21)
    plan = decode.plan_decode(4, *HEAD_SHAPES[4][:3], DEVICE)
    run_decode(decode_batch(random_lengths(4, generator), HEAD_SHAPES[4], generator), plan=plan)
    slow_before = decode._launch_split.slow_launches
    batch = decode_batch(random_lengths(4, generator), HEAD_SHAPES[4], generator)
    assert_matches(run_decode(batch, out=poisoned_like(batch.q), plan=plan), batch)
    assert decode._launch_split.slow_launches == slow_before
