"""BlockManager: hands out KV cache blocks and shares full blocks between equal prefixes.

A block becomes shareable once it is full and its K/V are computed: it is then registered
under the hash of its tokens chained with the hash of the block before it, so equal hashes
mean equal prefixes. Freed blocks keep their hash and stay findable until a fresh block is
needed and they are the least recently freed (LRU eviction).

Blocks are made on first use: a small model on a large GPU has a cache of millions of blocks
(a tiny test model on an H200: 130 million), far more than a run touches, and one object
each would take minutes and gigabytes before the first step. Untouched blocks count as
freed before any other, so they are handed out first, in id order.

A hybrid model's sequences also hold a recurrent state slot: taken with their first blocks,
released with them (finish, abort, preemption), so the scheduler handles both as one.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

from bcg.engine.sequence import Sequence
from bcg.engine.state_slots import StateSlotPool
from bcg.utils import cdiv


class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()  # checked on a hit: hashes may collide


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_state_slots: int = 0):
        self.block_size = block_size
        self.state_slots = StateSlotPool(num_state_slots) if num_state_slots else None
        self.enable_prefix_caching = enable_prefix_caching
        self.num_blocks = num_blocks
        self.blocks: dict[int, Block] = {}  # block id -> block, for the blocks used so far
        self.num_untouched = num_blocks  # the last ids, never handed out yet
        self.free_blocks: OrderedDict[int, None] = OrderedDict()  # used ones, least recent first
        self.cached_blocks: dict[int, int] = {}  # hash -> block id

    @property
    def num_free_blocks(self) -> int:
        return self.num_untouched + len(self.free_blocks)

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, cdiv(total, self.block_size) - len(seq.block_table))

    def try_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give `seq` blocks for its next `num_new_tokens` tokens if enough are free; return
        whether it did (nothing is taken otherwise). One check per sequence per step."""
        needed = self.num_blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            return False
        if self.state_slots is not None and seq.state_slot < 0:
            slot = self.state_slots.allocate()
            if slot is None:
                return False
            seq.state_slot = slot
        for _ in range(needed):
            seq.block_table.append(self._take_fresh_block())
        return True

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """Point a new sequence's first blocks at cached ones; return the tokens covered.
        The last prompt token is always left to compute: its logits are needed."""
        assert not seq.block_table
        if not self.enable_prefix_caching:
            return 0
        self._hash_full_blocks(seq, seq.num_tokens - 1)
        for i, block_hash in enumerate(seq.block_hashes[: (seq.num_tokens - 1) // self.block_size]):
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != self._block_tokens(seq, i):
                break
            self._share(block_id)
            seq.block_table.append(block_id)
        return len(seq.block_table) * self.block_size

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the blocks of `seq` that are now full and computed, for later sharing.
        Each block is offered once: one whose tokens another block already serves is not
        retried, even if that block is evicted later (a lost hit, never a wrong one)."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_offered_blocks:  # most steps: a decode fills a block in 16
            return
        self._hash_full_blocks(seq, seq.num_computed_tokens)
        for i in range(seq.num_offered_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and seq.block_hashes[i] not in self.cached_blocks:
                block.hash, block.token_ids = seq.block_hashes[i], self._block_tokens(seq, i)
                self.cached_blocks[block.hash] = block.block_id
        seq.num_offered_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Release the blocks of `seq`; its last blocks become the first to be evicted."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
        seq.block_table = array("i")
        seq.num_offered_blocks = 0
        if seq.state_slot >= 0:
            self.state_slots.free(seq.state_slot)
            seq.state_slot = -1

    def _hash_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Extend `seq.block_hashes` over the full blocks among its first `num_tokens` tokens."""
        for i in range(len(seq.block_hashes), num_tokens // self.block_size):
            parent = seq.block_hashes[i - 1] if i else None
            seq.block_hashes.append(hash((parent, self._block_tokens(seq, i))))

    def _block_tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])

    def _share(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_blocks[block_id]
        block.ref_count += 1

    def _take_fresh_block(self) -> int:
        if self.num_untouched:
            block_id = self.num_blocks - self.num_untouched
            self.num_untouched -= 1
            block = self.blocks[block_id] = Block(block_id)
        else:
            block_id, _ = self.free_blocks.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:
                del self.cached_blocks[block.hash]
                block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id
