"""How rank 0 hands each step to the other tensor-parallel ranks. A step's plan is a few
flat integer arrays, sent as bytes one of two ways:

- `PipeStepChannel`: workers that rank 0 spawned on its host each read theirs from a pipe
  of their own. A pipe wakes its reader within microseconds; the group's TCP sockets took
  0.5-1.6 ms a step for a 6.5 KB plan on two H200s (README, Tensor parallelism).
- `GroupStepChannel`: ranks that torchrun started (maybe on several hosts) take it from a
  broadcast on the CPU (gloo) group; most plans fit one fixed-size broadcast, and a longer
  one (large batches, long block tables) takes a second for the rest.
"""

from __future__ import annotations

import struct
from multiprocessing.connection import Connection
from typing import Protocol

import torch
import torch.distributed as dist

from bcg.distributed.parallel_state import TensorParallel

INLINE_BYTES = 4 * 1024  # the first broadcast's part: small decode steps fit; more takes a second
_LENGTH = struct.Struct("<q")
_SHUTDOWN = -1


class StepChannel(Protocol):
    def send(self, payload: bytes) -> None:
        """Rank 0: every other rank's `receive` returns `payload` (never empty)."""

    def send_shutdown(self) -> None:
        """Rank 0: every other rank's `receive` returns None."""

    def receive(self) -> bytes | None:
        """The other ranks: the next message of rank 0, or None when it shuts down."""


def open_step_channel(tp: TensorParallel) -> StepChannel:
    """Rank 0's pipes to the workers it spawned, or a worker's own (`tp.step_pipes`); else
    the group's broadcast."""
    return PipeStepChannel(tp.step_pipes) if tp.step_pipes else GroupStepChannel(tp)


class PipeStepChannel:
    """Rank 0 writes each message to every worker's pipe; a worker reads its own. The empty
    message is the shutdown (a plan's bytes never are)."""

    def __init__(self, pipes: tuple[Connection, ...]) -> None:
        self.pipes = pipes  # rank 0: a writing end per worker; a worker: its reading end

    def send(self, payload: bytes) -> None:
        assert payload, "a plan's bytes are never empty: the empty message is the shutdown"
        for pipe in self.pipes:
            pipe.send_bytes(payload)

    def send_shutdown(self) -> None:
        for pipe in self.pipes:
            pipe.send_bytes(b"")

    def receive(self) -> bytes | None:
        try:
            message = self.pipes[0].recv_bytes()
        except EOFError:
            raise RuntimeError("rank 0 closed its step channel without shutting down (it "
                               "ended): this rank stops too") from None
        return message or None


class GroupStepChannel:
    def __init__(self, tp: TensorParallel) -> None:
        self.group = tp.cpu_group
        self._buffer = torch.zeros(_LENGTH.size + INLINE_BYTES, dtype=torch.uint8)
        self._view = memoryview(self._buffer.numpy())

    def send(self, payload: bytes) -> None:
        self._broadcast_length_and_head(len(payload), payload)
        if len(payload) > INLINE_BYTES:
            rest = torch.frombuffer(bytearray(payload[INLINE_BYTES:]), dtype=torch.uint8)
            dist.broadcast(rest, 0, group=self.group)

    def send_shutdown(self) -> None:
        self._broadcast_length_and_head(_SHUTDOWN, b"")

    def receive(self) -> bytes | None:
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
