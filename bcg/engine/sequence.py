"""A request as the scheduler sees it: its tokens, its place in the KV cache, its state."""

from __future__ import annotations

from array import array
from enum import Enum, auto

import torch

from bcg.engine.sampling_params import SamplingParams


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

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
