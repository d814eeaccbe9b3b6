"""How rank 0 hands each step to the other tensor-parallel ranks. A step's plan is a few
flat integer arrays, sent as bytes one of two ways:

- `PipeStepChannel`: workers that rank 0 spawned on its host each read theirs from a pipe
  of their own (the gloo group's broadcast took rank 0 0.5-1.6 ms a step for a 6.5 KB plan
  on two H200s; a pipe's write took 19 µs on the CI machine: README, Session 34).
- `GroupStepChannel`: ranks that torchrun started (maybe on several hosts) take it from a
  broadcast on the CPU (gloo) group; most plans fit one fixed-size broadcast, and a longer
  one (large batches, long block tables) takes a second for the rest.
"""

from __future__ import annotations

import os
import select
import struct
from multiprocessing.connection import Connection
from typing import Protocol

import torch
import torch.distributed as dist

from bcg.distributed.parallel_state import TensorParallel, peer_failed

INLINE_BYTES = 4 * 1024  # the first broadcast's part: small decode steps fit; more takes a second
WRITE_WAIT_SECONDS = 0.2  # a full pipe: how long rank 0 waits for room before checking again
_LENGTH = struct.Struct("<q")
_SHUTDOWN = -1


class StepChannel(Protocol):
    def send(self, payload: bytes) -> None:
        """Rank 0: every other rank's `receive` returns `payload`."""

    def send_shutdown(self) -> None:
        """Rank 0: every other rank's `receive` returns None."""

    def receive(self) -> bytes | None:
        """The other ranks: the next message of rank 0, or None when it shuts down."""


def open_step_channel(tp: TensorParallel) -> StepChannel:
    """Rank 0's pipes to the workers it spawned, or a worker's own (`tp.step_pipes`); else
    the group's broadcast."""
    return PipeStepChannel(tp.step_pipes) if tp.step_pipes else GroupStepChannel(tp)


class PipeStepChannel:
    """Rank 0 writes each message, its length first, to every worker's pipe; a worker reads
    its own. Rank 0's ends do not block: where a pipe is full (a plan larger than its buffer,
    a worker slow to read) it waits for room, and gives up once a worker failed, so a stuck
    worker cannot hold it in a write for good."""

    def __init__(self, pipes: tuple[Connection, ...]) -> None:
        self.pipes = pipes  # rank 0: a writing end per worker (rank i + 1); a worker: its own
        for pipe in pipes:
            if pipe.writable:
                os.set_blocking(pipe.fileno(), False)

    def send(self, payload: bytes) -> None:
        self._write_to_each(_LENGTH.pack(len(payload)) + payload)

    def send_shutdown(self) -> None:
        self._write_to_each(_LENGTH.pack(_SHUTDOWN))

    def receive(self) -> bytes | None:
        fd = self.pipes[0].fileno()
        (length,) = _LENGTH.unpack(_read_exactly(fd, _LENGTH.size))
        return None if length == _SHUTDOWN else _read_exactly(fd, length)

    def _write_to_each(self, frame: bytes) -> None:
        for index, pipe in enumerate(self.pipes):
            try:
                _write_all(pipe.fileno(), memoryview(frame))
            except OSError as error:  # the worker is gone (a broken pipe)
                raise RuntimeError(f"tensor-parallel rank {index + 1}'s step pipe broke "
                                   f"({error.strerror or error})") from error


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        try:
            data = data[os.write(fd, data):]
        except BlockingIOError:
            if peer_failed():
                raise RuntimeError("a tensor-parallel worker failed while rank 0 waited to "
                                   "write the next step to another") from None
            room = select.poll()  # not select(): no limit on the fd's number
            room.register(fd, select.POLLOUT)
            room.poll(WRITE_WAIT_SECONDS * 1000)


def _read_exactly(fd: int, size: int) -> bytes:
    parts = []
    while size:
        part = os.read(fd, size)
        if not part:
            raise RuntimeError("rank 0 closed its step channel without shutting down (it "
                               "ended): this rank stops too")
        parts.append(part)
        size -= len(part)
    return b"".join(parts)


class GroupStepChannel:
    """Rank 0 broadcasts each message on the group's CPU (gloo) group."""

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
