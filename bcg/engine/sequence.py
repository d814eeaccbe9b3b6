"""A request as the scheduler sees it: its tokens, its place in the KV cache, its state."""

from __future__ import annotations

from array import array
from enum import Enum, auto

import torch

from bcg.engine.sampling_params import SamplingParams

# Stands in `token_ids` for a token sampled on the device but not yet on the host
# (overlapped steps): the next step reads the real one from the device; -1 fails loudly if
# anything reads it on the host.
PENDING_TOKEN = -1


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        # Copied once so each step's output need not slice `token_ids`; shared, read-only.
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.generator = generator
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache on admission
        # An int32 array: the runner copies every table into one buffer each step.
        self.block_table = array("i")
        self.block_hashes: list[int] = []  # hash of each full block of token_ids, in order
        self.num_offered_blocks = 0  # leading blocks already offered to the prefix cache
        self.state_slot = -1  # a hybrid's recurrent state slot while running; -1: none
        # Overlapped steps: its last tokens may be sampled on the device but not yet on the
        # host (PENDING_TOKEN in `token_ids`); the newest one's row in the samples of the step
        # that drew it (the runner reads it there), -1 when none is pending.
        self.num_pending_tokens = 0
        self.pending_sample_row = -1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens the host has (pending ones excluded)."""
        return self.token_ids[self.num_prompt_tokens : self.num_tokens - self.num_pending_tokens]

    @property
    def num_output_tokens(self) -> int:
        """Tokens sampled so far, pending ones included."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_known_output_tokens(self) -> int:
        return self.num_output_tokens - self.num_pending_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def needs_compute(self) -> bool:
        """Whether a step should compute for it: not when nothing is left to compute (a
        prompt only scored, awaiting its finish) nor when the last token it may produce is
        still in flight (overlapped steps)."""
        if self.num_uncomputed_tokens == 0:
            return False
        return not (self.num_pending_tokens
                    and self.num_output_tokens >= self.sampling_params.max_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def append_pending_token(self, sample_row: int) -> None:
        """A token sampled on the device, at `sample_row` of its step's samples."""
        self.token_ids.append(PENDING_TOKEN)
        self.num_pending_tokens += 1
        self.pending_sample_row = sample_row

    def resolve_pending_token(self, token_id: int) -> None:
        """The oldest pending token reached the host."""
        self.token_ids[self.num_tokens - self.num_pending_tokens] = token_id
        self.num_pending_tokens -= 1
        if not self.num_pending_tokens:
            self.pending_sample_row = -1

    def finish(self, reason: str) -> None:
        """End it; tokens still pending (drawn after it stopped) are dropped."""
        del self.token_ids[self.num_tokens - self.num_pending_tokens :]
        self.num_pending_tokens, self.pending_sample_row = 0, -1
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
