"""Scheduled sequences in, one `ForwardBatch` out: the host side of every step.

The runner knows sequences only through `ScheduledSequence`. `SyntheticSequence` is the one
stand-in for a sequence at start-up (graph capture, the activation profile, verification,
benchmarks): a prompt with a block table and nothing else.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Protocol

import torch

from bcg.forward import ForwardBatch
from bcg.utils import leading_single_tokens

ALIGN_BYTES = 16  # Triton's pointer specialisation: every batch tensor starts on this


class SamplingOptions(Protocol):
    """What the runner reads of a request's sampling parameters (`SamplingParams`)."""

    temperature: float
    top_k: int  # 0 or less = off
    top_p: float
    min_p: float  # 0 = off
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float  # 1 = off
    logit_bias: dict[int, float] | None
    min_tokens: int  # EOS and stop tokens are banned before this many new tokens
    stop_token_ids: list[int]
    logprobs: int | None  # alternatives per sampled token; None = no logprobs
    prompt_logprobs: int | None  # the same for prompt tokens
    processes_logits: bool  # any of logit_bias, min_tokens or the penalties is set


class ScheduledSequence(Protocol):
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens whose K/V are already in the cache
    block_table: array | list[int]  # array('i') (copied fastest) or a list of ints
    state_slot: int  # recurrent state slot of a hybrid's sequence; -1: none
    # Its last token's row in the last step's samples while the host waits for it
    # (overlapped steps; `token_ids` holds a stand-in there); -1: the host has it.
    pending_sample_row: int
    sampling_params: SamplingOptions
    generator: torch.Generator | None


@dataclass(frozen=True)
class SlowestSampling:
    """Sampling that takes the sampler's longest path (the activation profile's)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.9
    min_p: float = 0.1
    presence_penalty: float = 0.5
    frequency_penalty: float = 0.5
    repetition_penalty: float = 1.1
    logit_bias: None = None
    min_tokens: int = 0
    stop_token_ids: tuple = ()
    logprobs: None = None
    prompt_logprobs: None = None
    processes_logits: bool = True


@dataclass
class SyntheticSequence:
    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int = 0
    state_slot: int = -1  # no state kept
    pending_sample_row: int = -1
    sampling_params: SamplingOptions = field(default_factory=SlowestSampling)
    generator: None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.token_ids)


def pending_token_rows(seqs: list[ScheduledSequence], num_new_tokens: list[int]) -> array:
    """(input row, sample row) pairs, flat: each sequence whose last token this step computes
    while the host still waits for it (`pending_sample_row`: where the last step's samples
    hold it)."""
    rows, end = array("q"), 0
    for seq, n in zip(seqs, num_new_tokens, strict=True):
        end += n
        if seq.pending_sample_row >= 0 and seq.num_computed_tokens + n == len(seq.token_ids):
            rows.extend((end - 1, seq.pending_sample_row))
    return rows


def upload_longs(values: array, device: torch.device) -> torch.Tensor:
    """An int64 `array` on `device`, copied without waiting."""
    return _upload(values, [len(values)], torch.int64, device)[0]


def samples_this_step(seq: ScheduledSequence, num_new_tokens: int) -> bool:
    """A sequence samples once its last known token is computed (not after a partial chunk)."""
    return seq.num_computed_tokens + num_new_tokens == len(seq.token_ids)


def build_batch(seqs: list[ScheduledSequence], num_new_tokens: list[int], block_size: int,
                device: torch.device, store_kv: bool = True,
                stateful: bool = False) -> ForwardBatch:
    """The next `num_new_tokens` of each sequence as one batch on `device`. With `store_kv`
    False every cache slot is -1: attention reads the cache but writes nothing to it.
    `stateful` (a model with recurrent state) adds the sequences' state slots."""
    return build_host_batch(seqs, num_new_tokens, block_size, store_kv, stateful).upload(device)


@dataclass(frozen=True)
class HostBatch:
    """A step's batch on the host: two flat arrays (int64 and int32 fields, each field
    16-byte aligned) and its sizes. `upload` makes the `ForwardBatch`; tensor-parallel
    workers receive these arrays' bytes from rank 0 and upload them themselves."""

    longs: array  # 'q': input_ids | positions | slot_mapping | sample_indices
    ints: array  # 'i': cu_seqlens_q | seq_lens | block_tables | state_slots (stateful only)
    num_tokens: int
    num_seqs: int
    num_samples: int
    max_blocks: int
    max_seqlen_q: int
    max_seq_len: int
    num_decode_seqs: int
    stateful: bool  # a model with recurrent state: ints end with one state slot per sequence

    def sizes(self) -> list[int]:
        return [self.num_tokens, self.num_seqs, self.num_samples, self.max_blocks,
                self.max_seqlen_q, self.max_seq_len, self.num_decode_seqs, int(self.stateful)]

    def upload(self, device: torch.device) -> ForwardBatch:
        tokens, seqs = self.num_tokens, self.num_seqs
        longs = _upload(self.longs, [tokens, tokens, tokens, self.num_samples], torch.int64,
                        device)
        ints = _upload(self.ints, [seqs + 1, seqs, seqs * self.max_blocks,
                                   seqs if self.stateful else 0], torch.int32, device)
        return ForwardBatch(
            input_ids=longs[0],
            positions=longs[1],
            slot_mapping=longs[2],
            sample_indices=longs[3],
            cu_seqlens_q=ints[0],
            seq_lens=ints[1],
            block_tables=ints[2].view(seqs, self.max_blocks),
            state_slots=ints[3] if self.stateful else None,
            num_tokens=tokens,
            num_seqs=seqs,
            max_seqlen_q=self.max_seqlen_q,
            max_seq_len=self.max_seq_len,
            num_decode_seqs=self.num_decode_seqs,
        )


def build_host_batch(seqs: list[ScheduledSequence], num_new_tokens: list[int], block_size: int,
                     store_kv: bool = True, stateful: bool = False) -> HostBatch:
    """`build_batch`'s host half: the fields as flat arrays, ready to upload or to send."""
    # Built in `array`s and sent as two buffers (int64, int32): Python lists and one tensor
    # per field cost milliseconds per step at hundreds of sequences.
    input_ids, positions, slots, sample_indices = (array("q") for _ in range(4))
    cu_seqlens_q, seq_lens, block_tables = array("i", [0]), array("i"), array("i")
    max_blocks = max((len(seq.block_table) for seq in seqs), default=0)
    padding = array("i", [-1]) * max_blocks
    for seq, n in zip(seqs, num_new_tokens, strict=True):
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        if store_kv:
            table = seq.block_table
            slots.extend([table[p // block_size] * block_size + p % block_size
                          for p in range(start, end)])
        cu_seqlens_q.append(cu_seqlens_q[-1] + n)
        seq_lens.append(end)
        if samples_this_step(seq, n):
            sample_indices.append(cu_seqlens_q[-1] - 1)
        block_tables.extend(seq.block_table)
        block_tables.extend(padding[: max_blocks - len(seq.block_table)])
    if not store_kv:
        slots = array("q", [-1]) * len(input_ids)
    int_parts = [cu_seqlens_q, seq_lens, block_tables]
    if stateful:
        int_parts.append(array("i", [seq.state_slot for seq in seqs]))
    return HostBatch(
        longs=_aligned([input_ids, positions, slots, sample_indices]),
        ints=_aligned(int_parts),
        num_tokens=len(input_ids),
        num_seqs=len(seqs),
        num_samples=len(sample_indices),
        max_blocks=max_blocks,
        max_seqlen_q=max(num_new_tokens, default=1),
        max_seq_len=max(seq_lens, default=0),
        num_decode_seqs=leading_single_tokens(num_new_tokens),
        stateful=stateful,
    )


def _aligned(parts: list[array]) -> array:
    """`parts` (one typecode) end to end, each starting 16-byte aligned: kernels specialise
    on pointer alignment, and a misaligned one misses the launch cache (a compile, then a
    slow launch every step)."""
    flat = array(parts[0].typecode)
    align = ALIGN_BYTES // flat.itemsize
    for part in parts:
        flat.extend(part)
        flat.extend(array(flat.typecode, [0]) * (-len(flat) % align))
    return flat


def _upload(flat: array, lengths: list[int], dtype: torch.dtype,
            device: torch.device) -> list[torch.Tensor]:
    """`flat` (as `_aligned` laid it out: parts of `lengths`) on `device`: one host buffer,
    one copy, a view per part."""
    host = torch.frombuffer(flat, dtype=dtype) if flat else torch.empty(0, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    on_device = host.to(device, non_blocking=True)
    align = ALIGN_BYTES // flat.itemsize
    views, offset = [], 0
    for length in lengths:
        views.append(on_device[offset : offset + length])
        offset += length + (-(offset + length) % align)
    return views
