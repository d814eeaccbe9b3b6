"""Extend (prefill) attention over a paged prefix (Triton) against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from tests.kernels_support import (
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

extend = import_kernels("extend_attention")

MAX_NEW = 700 if ON_GPU else 40
MAX_PREFIX = 2000 if ON_GPU else 50
MAX_SEQS = 8 if ON_GPU else 4
PADDING_TOKENS = 5


def random_batch(head_shape: tuple, generator: torch.Generator, **kwargs) -> PagedBatch:
    """Random new-token and prefix lengths, always including 1 new token and no prefix."""
    num_seqs = int(torch.randint(1, MAX_SEQS + 1, (1,), generator=generator))
    q_lens = torch.randint(1, MAX_NEW + 1, (num_seqs,), generator=generator).tolist()
    prefixes = torch.randint(0, MAX_PREFIX + 1, (num_seqs,), generator=generator).tolist()
    q_lens[0], prefixes[-1] = 1, 0
    return batch_of(q_lens, prefixes, head_shape, generator, **kwargs)


def batch_of(
    q_lens: list[int], prefixes: list[int], head_shape: tuple, generator: torch.Generator,
    **kwargs,
) -> PagedBatch:
    seq_lens = [q + p for q, p in zip(q_lens, prefixes, strict=True)]
    return make_paged_batch(
        q_lens, seq_lens, *head_shape, generator, padding_tokens=PADDING_TOKENS, **kwargs
    )


def run_extend(batch: PagedBatch, out: torch.Tensor) -> torch.Tensor:
    return extend.extend_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens,
        batch.block_tables, batch.scale, out=out,
    )


def assert_matches(out: torch.Tensor, batch: PagedBatch) -> None:
    """Real tokens match the reference; padding tokens were not written."""
    real = batch.num_real_tokens
    assert relative_error(out[:real], reference_attention(batch)[:real]) <= TOLERANCE
    assert (out[real:] == POISON).all()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("head_shape", HEAD_SHAPES, ids=str)
def test_extend_matches_reference(head_shape: tuple, seed: int) -> None:
    batch = random_batch(head_shape, torch.Generator().manual_seed(seed))
    assert_matches(run_extend(batch, poisoned_like(batch.q)), batch)


@pytest.mark.parametrize("head_shape", HEAD_SHAPES[1:3], ids=str)
def test_prefill_without_prefix(head_shape: tuple) -> None:
    generator = torch.Generator().manual_seed(5)
    batch = batch_of([MAX_NEW, 1, MAX_NEW // 2 + 3], [0, 0, 0], head_shape, generator)
    assert_matches(run_extend(batch, poisoned_like(batch.q)), batch)


def test_mixed_decode_and_prefill() -> None:
    """Many one-token rows beside a long prefill, as in a mixed breakable-prefill batch."""
    generator = torch.Generator().manual_seed(9)
    q_lens = [1] * 9 + [MAX_NEW]
    prefixes = torch.randint(0, MAX_PREFIX, (10,), generator=generator).tolist()
    batch = batch_of(q_lens, prefixes, HEAD_SHAPES[1], generator)
    assert_matches(run_extend(batch, poisoned_like(batch.q)), batch)


def test_any_number_of_sequences_shares_one_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    """1, 2 and 3 chunks of the tile lookup (3, 70 and 134 sequences on a GPU), block tables
    of growing width: every launch has the same constexprs, so a growing batch never
    compiles a new kernel mid-run."""
    launches = record_launches(monkeypatch, extend, "_launch_extend")
    generator = torch.Generator().manual_seed(21)
    chunk = extend.CONFIGS.for_device(ON_GPU).seq_chunk
    for num_seqs in (3, chunk + 6, 2 * chunk + 6):
        q_lens = torch.randint(1, 6, (num_seqs,), generator=generator).tolist()
        prefixes = torch.randint(0, num_seqs, (num_seqs,), generator=generator).tolist()
        batch = batch_of(q_lens, prefixes, HEAD_SHAPES[1], generator)
        assert_matches(run_extend(batch, poisoned_like(batch.q)), batch)
    assert len(launches) == 3
    assert launches[0] == launches[1] == launches[2]


def test_oversized_group_is_refused() -> None:
    batch = batch_of([3], [2], (64, 1, 64, 16), torch.Generator().manual_seed(0))
    config = extend.ExtendConfig(block_m=32, block_n=16, num_warps=1, num_stages=1)
    with pytest.raises(ValueError, match="block_m"):
        extend.extend_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.cu_seqlens_q, batch.seq_lens,
            batch.block_tables, batch.scale, config=config,
        )


@pytest.mark.gpu
def test_graph_replay_with_new_batch_composition() -> None:
    """The grid depends on shapes only: one capture serves other splits of the tokens."""
    generator = torch.Generator().manual_seed(13)
    head_shape, max_blocks = HEAD_SHAPES[4], 200
    static = batch_of([300, 200, 100], [500, 0, 1000], head_shape, generator,
                      max_blocks=max_blocks)
    static_out = torch.empty_like(static.q)
    run_extend(static, static_out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_extend(static, static_out)

    for q_lens, prefixes in (([1, 1, 598], [7, 0, 2500]), ([600, 0, 0], [33, 0, 0])):
        fresh = batch_of(q_lens, prefixes, head_shape, generator, max_blocks=max_blocks)
        for name in ("q", "k_cache", "v_cache", "cu_seqlens_q", "seq_lens", "block_tables"):
            getattr(static, name).copy_(getattr(fresh, name))
        poison(static_out)
        graph.replay()
        assert_matches(static_out, static)


@pytest.mark.gpu
def test_repeated_calls_take_the_fast_launch_path() -> None:
    """Same shapes, new tensors: the launch skips JITFunction.run and stays correct."""
    generator = torch.Generator().manual_seed(17)
    first = batch_of([40, 3], [100, 0], HEAD_SHAPES[4], generator)
    run_extend(first, torch.empty_like(first.q))
    slow_before = extend._launch_extend.slow_launches
    batch = batch_of([20, 23], [7, 300], HEAD_SHAPES[4], generator)
    assert_matches(run_extend(batch, poisoned_like(batch.q)), batch)
    assert extend._launch_extend.slow_launches == slow_before
