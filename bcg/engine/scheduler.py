"""Scheduler: picks the sequences of each step and how many tokens each one computes.

Continuous batching with chunked prefill: a step holds at most `max_num_batched_tokens`
tokens, and may mix decodes (1 token), prompt chunks and new prompts. Running sequences
come first, decodes (longest context first) before prompt chunks, then waiting sequences
in arrival order. When the KV cache runs out, the most recently admitted sequence not yet
scheduled this step is preempted: its blocks are freed and it waits to be recomputed (its
tokens are kept, so greedy output is unchanged, and the prefix cache usually brings most of
it back).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter

from bcg.engine.block_manager import BlockManager
from bcg.engine.sequence import Sequence, SequenceStatus
from bcg.utils import leading_single_tokens


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens each computes this step
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)

    def put_longest_decodes_first(self) -> None:
        """Order the one-token rows at the front (the decodes, and any prompt with one
        token left) by the KV they read, longest first. Decode attention starts its programs
        in row order; with the long sequences first, short ones fill the device's last wave
        instead of one long sequence running alone."""
        num_decodes = leading_single_tokens(self.num_new_tokens)
        self.seqs[:num_decodes] = sorted(self.seqs[:num_decodes],
                                         key=attrgetter("num_computed_tokens"), reverse=True)


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self._schedule_running(output)
        if not output.num_preempted:
            self._schedule_waiting(output, budget)
        output.put_longest_decodes_first()
        return output

    def advance(self, output: SchedulerOutput) -> list[Sequence]:
        """Once the step is issued: count its tokens as computed and return the sequences
        that sample a token in it, in order."""
        sampled = []
        for seq, n in zip(output.seqs, output.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                sampled.append(seq)
        return sampled

    def cache_computed_blocks(self, output: SchedulerOutput) -> None:
        """Once the step's tokens are on the host: offer the blocks it filled to the prefix
        cache (a block is hashed by its tokens, so none may still be pending)."""
        for seq in output.seqs:
            if not seq.is_finished:
                self.block_manager.cache_computed_blocks(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` (running or waiting) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.finish(reason)

    def _schedule_running(self, output: SchedulerOutput) -> int:
        budget = self.max_num_batched_tokens
        ready = (seq for seq in self.running if seq.needs_compute)
        queue = deque(sorted(ready, key=lambda s: s.num_uncomputed_tokens > 1))
        while queue and budget > 0:
            seq = queue.popleft()
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.try_allocate(seq, n):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                output.num_preempted += 1
                if victim is seq:
                    return budget
            output.add(seq, n)
            budget -= n
        return budget

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # A prompt to score is computed whole: cached blocks would skip its logprobs.
            if seq.sampling_params.prompt_logprobs is None:
                seq.num_computed_tokens = self.block_manager.allocate_cached_prefix(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.try_allocate(seq, n):
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0
                break
            if not seq.num_output_tokens:
                seq.num_cached_tokens = seq.num_computed_tokens
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            output.add(seq, n)
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        """Free the blocks of `seq` and queue it first, to be recomputed from its tokens."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
