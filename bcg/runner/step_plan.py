"""What every tensor-parallel rank runs in one step, as rank 0 sends it: the host batch, the
rows whose logits the step computes for prompt logprobs, and (overlapped steps) which input
rows take a token from the last step's samples. The LM head gathers its
vocabulary slices from every rank, so each rank must run the head on the same rows; only
rank 0 samples. Encoded as raw integer arrays: no pickling, no per-sequence work on the
receiving ranks."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field, fields

from bcg.runner.batch import HostBatch

# HostBatch.sizes() (its fields but the two arrays), then the lengths of longs, ints,
# prompt_rows and pending_rows.
_HEADER_FIELDS = len(fields(HostBatch)) - 2 + 4


@dataclass(frozen=True)
class StepPlan:
    batch: HostBatch
    prompt_rows: array  # 'q': hidden-state rows scored for prompt logprobs, in order
    # 'q': (input row, row of the last step's samples) pairs, flat: tokens still on the device
    pending_rows: array = field(default_factory=lambda: array("q"))

    def to_bytes(self) -> bytes:
        batch = self.batch
        header = array("q", [*batch.sizes(), len(batch.longs), len(batch.ints),
                             len(self.prompt_rows), len(self.pending_rows)])
        return b"".join((header.tobytes(), batch.longs.tobytes(), batch.ints.tobytes(),
                         self.prompt_rows.tobytes(), self.pending_rows.tobytes()))

    @classmethod
    def from_bytes(cls, data: bytes) -> StepPlan:
        header = array("q")
        header.frombytes(data[: _HEADER_FIELDS * header.itemsize])
        *sizes, num_longs, num_ints, num_rows, num_pending = header
        parts, offset = [], len(header) * header.itemsize
        for typecode, count in (("q", num_longs), ("i", num_ints), ("q", num_rows),
                                ("q", num_pending)):
            part = array(typecode)
            end = offset + count * part.itemsize
            part.frombytes(data[offset:end])
            parts.append(part)
            offset = end
        longs, ints, prompt_rows, pending_rows = parts
        return cls(HostBatch(longs, ints, *sizes), prompt_rows, pending_rows)
