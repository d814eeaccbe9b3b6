import pytest

from bcg.engine.block_manager import BlockManager
from bcg.engine.sampling_params import SamplingParams
from bcg.engine.sequence import Sequence

BLOCK = 4


def seq(tokens: list[int], name: str = "s") -> Sequence:
    return Sequence(name, tokens, SamplingParams())


def compute(manager: BlockManager, s: Sequence, n: int) -> None:
    """What a step does to a sequence's blocks: allocate, compute, offer full blocks."""
    assert manager.try_allocate(s, n)
    s.num_computed_tokens += n
    manager.cache_computed_blocks(s)


def admit(manager: BlockManager, s: Sequence) -> int:
    s.num_computed_tokens = manager.allocate_cached_prefix(s)
    return s.num_computed_tokens


def test_allocation_covers_tokens_and_grows_one_block_at_a_time():
    manager = BlockManager(10, BLOCK)
    s = seq(list(range(9)))
    compute(manager, s, 9)
    assert len(s.block_table) == 3 and manager.num_free_blocks == 7
    for token in range(3):  # positions 9, 10, 11 fit the third block
        s.append_token(token)
        compute(manager, s, 1)
    assert len(s.block_table) == 3
    s.append_token(0)
    compute(manager, s, 1)
    assert len(s.block_table) == 4 and len(set(s.block_table)) == 4


def test_try_allocate_counts_only_missing_blocks_and_takes_nothing_when_short():
    manager = BlockManager(3, BLOCK)
    s = seq(list(range(20)))
    assert not manager.try_allocate(s, 13)
    assert len(s.block_table) == 0 and manager.num_free_blocks == 3
    compute(manager, s, 12)
    assert manager.num_blocks_needed(s, 0) == 0 and not manager.try_allocate(s, 1)


def test_prefix_sharing_and_reference_counts():
    manager = BlockManager(10, BLOCK)
    first = seq(list(range(10)), "a")
    compute(manager, first, 10)
    second = seq(list(range(8)) + [99, 98, 97], "b")
    assert admit(manager, second) == 8
    assert second.block_table == first.block_table[:2]
    assert [manager.blocks[b].ref_count for b in first.block_table] == [2, 2, 1]
    compute(manager, second, second.num_uncomputed_tokens)
    assert second.block_table[2] != first.block_table[2]
    manager.free(first)
    assert [manager.blocks[b].ref_count for b in second.block_table] == [1, 1, 1]


def test_last_prompt_token_is_never_served_from_cache():
    manager = BlockManager(10, BLOCK)
    compute(manager, first := seq(list(range(8)), "a"), 8)
    again = seq(list(range(8)), "b")
    assert admit(manager, again) == 4  # the second block holds the last token: computed anew
    assert again.block_table == first.block_table[:1]


def test_different_prefix_does_not_match_later_blocks():
    manager = BlockManager(10, BLOCK)
    compute(manager, seq(list(range(12)), "a"), 12)
    other = seq([50] + list(range(1, 12)), "b")  # first block differs, later ones equal
    assert admit(manager, other) == 0


def test_freed_blocks_stay_cached_until_reused():
    manager = BlockManager(4, BLOCK)
    first = seq(list(range(9)), "a")
    compute(manager, first, 9)
    manager.free(first)
    assert manager.num_free_blocks == 4 and len(first.block_table) == 0
    hit = seq(list(range(9)), "b")
    assert admit(manager, hit) == 8
    assert manager.num_free_blocks == 2
    manager.free(hit)
    # Eviction order: never-cached blocks, then the cached ones from the sequence's end.
    filler = seq([7] * 12, "c")
    compute(manager, filler, 12)
    assert admit(manager, seq(list(range(9)), "d")) == 4


def test_free_returns_every_block_and_evicts_hashes_on_reuse():
    manager = BlockManager(3, BLOCK)
    a = seq(list(range(12)), "a")
    compute(manager, a, 12)
    manager.free(a)
    b = seq([5] * 12, "b")
    compute(manager, b, 12)
    assert manager.num_free_blocks == 0
    assert admit(manager, seq(list(range(12)) + [1], "c")) == 0
    manager.free(b)
    assert manager.num_free_blocks == 3


def test_recomputed_sequence_offers_its_blocks_again():
    """A preempted sequence whose cached blocks were evicted re-registers them when it is
    recomputed (the blocks it offered before are gone with its old block table)."""
    manager = BlockManager(3, BLOCK)
    first = seq(list(range(8)), "a")
    compute(manager, first, 8)
    manager.free(first)  # preempted
    first.num_computed_tokens = 0
    other = seq(list(range(100, 112)), "b")
    compute(manager, other, 12)  # takes every block: first's cached blocks are evicted
    manager.free(other)
    assert admit(manager, first) == 0
    compute(manager, first, 8 - first.num_computed_tokens)
    assert admit(manager, seq(list(range(8)) + [99], "c")) == 8


def test_prefix_caching_off_shares_nothing():
    manager = BlockManager(10, BLOCK, enable_prefix_caching=False)
    compute(manager, seq(list(range(12)), "a"), 12)
    assert admit(manager, seq(list(range(12)), "b")) == 0


def test_double_free_is_caught():
    manager = BlockManager(2, BLOCK)
    s = seq([1, 2])
    compute(manager, s, 2)
    table = list(s.block_table)
    manager.free(s)
    s.block_table = table
    with pytest.raises(AssertionError):
        manager.free(s)


def test_state_slots_come_with_the_first_blocks_and_go_with_them():
    manager = BlockManager(10, BLOCK, enable_prefix_caching=False, num_state_slots=2)
    first, second, third = seq([1, 2, 3], "a"), seq([4, 5], "b"), seq([6], "c")
    compute(manager, first, 2)
    compute(manager, first, 1)  # a later chunk keeps the slot
    compute(manager, second, 2)
    assert (first.state_slot, second.state_slot) == (0, 1)
    free_blocks = manager.num_free_blocks
    assert not manager.try_allocate(third, 1)  # no slot left: nothing taken
    assert third.state_slot == -1 and manager.num_free_blocks == free_blocks
    manager.free(first)
    assert first.state_slot == -1
    compute(manager, third, 1)
    assert third.state_slot == 0 and manager.state_slots.num_free == 0


def test_a_cache_of_a_billion_blocks_is_made_on_first_use():
    """A tiny model on a large GPU: 130 million blocks once took minutes to build."""
    manager = BlockManager(10**9, BLOCK)
    s = seq(list(range(9)))
    compute(manager, s, 9)
    assert list(s.block_table) == [0, 1, 2] and len(manager.blocks) == 3
    assert manager.num_free_blocks == 10**9 - 3
    manager.free(s)
    assert manager.num_free_blocks == 10**9


def test_untouched_blocks_go_before_freed_ones_whose_prefixes_stay_findable():
    manager = BlockManager(4, BLOCK)
    first = seq(list(range(8)), "a")
    compute(manager, first, 8)
    manager.free(first)
    fresh = seq([50 + i for i in range(8)], "b")
    compute(manager, fresh, 8)
    assert list(fresh.block_table) == [2, 3]  # never used: taken before the freed 0 and 1
    again = seq(list(range(8)) + [1], "c")
    assert admit(manager, again) == 8 and list(again.block_table) == [0, 1]
