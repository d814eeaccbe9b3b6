"""How rank 0 hands each step to the other tensor-parallel ranks: bytes broadcast on the CPU
(gloo) group, so the same code works for workers on this host and under torchrun across
hosts. A step's plan is a few flat integer arrays; most fit one fixed-size broadcast, and a
longer one (large batches, long block tables) takes a second for the rest."""

from __future__ import annotations

import struct

import torch
import torch.distributed as dist

from bcg.distributed.parallel_state import TensorParallel

INLINE_BYTES = 4 * 1024  # the first broadcast's part: small decode steps fit; more takes a second
_LENGTH = struct.Struct("<q")
_SHUTDOWN = -1


class StepChannel:
    def __init__(self, tp: TensorParallel) -> None:
        self.group = tp.cpu_group
        self._buffer = torch.zeros(_LENGTH.size + INLINE_BYTES, dtype=torch.uint8)
        self._view = memoryview(self._buffer.numpy())

    def send(self, payload: bytes) -> None:
        """Rank 0: every other rank's `receive` returns `payload`."""
        self._broadcast_length_and_head(len(payload), payload)
        if len(payload) > INLINE_BYTES:
            rest = torch.frombuffer(bytearray(payload[INLINE_BYTES:]), dtype=torch.uint8)
            dist.broadcast(rest, 0, group=self.group)

    def send_shutdown(self) -> None:
        """Rank 0: every other rank's `receive` returns None."""
        self._broadcast_length_and_head(_SHUTDOWN, b"")

    def receive(self) -> bytes | None:
        """The other ranks: the next message of rank 0, or None when it shuts down."""
        dist.broadcast(self._buffer, 0, group=self.group)
        (length,) = _LENGTH.unpack_from(self._view)
        if length == _SHUTDOWN:
            return None
        head = bytes(self._view[_LENGTH.size : _LENGTH.size + min(length, INLINE_BYTES)])
        if length <= INLINE_BYTES:
            return head
        rest = torch.empty(length - INLINE_BYTES, dtype=torch.uint8)
        dist.broadcast(rest, 0, group=self.group)
        return head + rest.numpy().tobytes()

    def _broadcast_length_and_head(self, length: int, payload: bytes) -> None:
        _LENGTH.pack_into(self._view, 0, length)
        head = payload[:INLINE_BYTES]
        self._view[_LENGTH.size : _LENGTH.size + len(head)] = head
        dist.broadcast(self._buffer, 0, group=self.group)
