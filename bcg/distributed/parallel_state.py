"""This process's place in the tensor-parallel group, and the collectives layers call.

One process per device; `init_tensor_parallel` joins the group with torch.distributed's
env-style initialisation (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), so the same code
starts under `torchrun` or from the engine's own launcher: NCCL on GPUs, gloo on the CPU
(so tests of several ranks run anywhere). Layers read the group when they are built.

Besides the device group every rank joins a gloo group on the CPU (`cpu_group`): the
start-up agreements (the KV cache size, the barriers between graph breaks) run on it without
touching the device's streams, and so do each step's batches under torchrun (workers that
rank 0 spawned read theirs from a pipe: `step_pipes`, `bcg.distributed.step_channel`). Its
timeout is long because a worker waits in it while the engine is idle.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Protocol

import torch
import torch.distributed as dist


class CustomAllReduce(Protocol):
    """An all-reduce kernel of our own for the messages it `takes`
    (bcg.distributed.custom_all_reduce, bcg.distributed.symm_mem)."""

    def takes(self, x: torch.Tensor) -> bool: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def takes_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor) -> bool: ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def takes_projection_add_rms_norm(self, x: torch.Tensor, weight: torch.Tensor,
                                      residual: torch.Tensor) -> bool: ...

    def projection_add_rms_norm(self, x: torch.Tensor, weight: torch.Tensor,
                                residual: torch.Tensor, norm_weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def release_waits(self) -> None: ...

    def release(self) -> None: ...


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed group; None for a single process
    cpu_group: Any = None  # a gloo group of the same ranks, for host-side messages
    custom_all_reduce: CustomAllReduce | None = None  # else every all-reduce is the group's
    # Each step's plan: rank 0's writing end to each worker it spawned, or such a worker's
    # reading end; empty under torchrun (the plans go through cpu_group)
    step_pipes: tuple[Connection, ...] = ()

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal share of `total` items of `what`."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size "
                             f"{self.size}: choose a size that divides it")
        length = total // self.size
        return self.rank * length, length

    def kv_heads(self, total: int) -> int:
        """KV heads per rank: an equal share, or one replicated head when there are fewer
        KV heads than ranks (the ranks then a multiple of them)."""
        if total >= self.size:
            return self.shard(total, "num_key_value_heads")[1]
        if self.size % total:
            raise ValueError(f"{total} KV heads cannot be replicated evenly over {self.size} "
                             f"tensor-parallel ranks: choose a size that {total} divides")
        return 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks: in place through the group, or into a new tensor through
        the custom kernel where it takes `x`; use the result."""
        if self.size == 1:
            return x
        if self.custom_all_reduce is not None and self.custom_all_reduce.takes(x):
            return self.custom_all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place."""
        if self.size > 1:
            dist.broadcast(x, group=self.group, group_src=0)
        return x

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (on the CPU group)."""
        if self.size == 1:
            return value
        smallest = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(smallest, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(smallest.item())

    def barrier(self) -> None:
        """Wait until every rank got here (on the CPU group: no device stream is touched)."""
        if self.size > 1:
            dist.barrier(group=self.cpu_group)

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` side by side along the last dimension, in rank order."""
        return x if self.size == 1 else torch.cat(self._all_gather(x), dim=-1)

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` stacked along the first dimension, in rank order."""
        return x if self.size == 1 else torch.cat(self._all_gather(x))

    def _all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return parts

    def all_to_all(self, x: torch.Tensor, send_counts: list[int],
                   recv_counts: list[int]) -> torch.Tensor:
        """Send the rows of `x`, in blocks of `send_counts` rows, block r to rank r; returns
        the `recv_counts` rows each rank sent here, in rank order (the host must know both)."""
        out = x.new_empty(sum(recv_counts), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=self.group)
        return out


_current = TensorParallel()
_abandoned: str | None = None  # why this process may not join a group again
_peer_failed = False  # rank 0 recorded a failed worker (`release_custom_all_reduce_waits`)


def tensor_parallel() -> TensorParallel:
    return _current


def set_custom_all_reduce(custom: CustomAllReduce | None) -> None:
    """Route the all-reduces it takes through `custom` (None: all through the group), for the
    layers built from now on (they keep the `TensorParallel` they were built with); the one
    it replaces is released."""
    global _current
    if _current.custom_all_reduce not in (None, custom):
        _current.custom_all_reduce.release()
    _current = replace(_current, custom_all_reduce=custom)
    if custom is not None and _peer_failed:  # read after the swap: see the release below
        custom.release_waits()


def peer_failed() -> bool:
    """Whether rank 0 recorded a failed worker in this group."""
    return _peer_failed


def release_custom_all_reduce_waits() -> None:
    """A peer of the group failed: end the waits of the custom all-reduce's kernel, the
    current one's and any set later in this group (one may be set while the failure is
    recorded: whichever of the two runs second releases it)."""
    global _peer_failed
    _peer_failed = True
    custom = _current.custom_all_reduce  # once: the main thread may set another meanwhile
    if custom is not None:
        custom.release_waits()


# A worker waits in the CPU group for the next step as long as the engine is idle.
CPU_GROUP_TIMEOUT = timedelta(days=365)
# From its start until it joins the group a worker that rank 0 spawned imports the runner and
# takes its GPU: seconds, a minute on a loaded machine. Rank 0 names one silent this long, and
# workers that are ready wait this long for the others (`release_spawned_group`).
SPAWNED_START_TIMEOUT = timedelta(minutes=5)
# The device group of workers that rank 0 spawned: every rank enters its rendezvous once rank
# 0 has heard from all of them, so one that dies in between is a clear error in this long
# (the rendezvous cannot be interrupted; torch's default would wait 10 to 30 minutes). Its
# collectives take milliseconds within a step, and ranks lag little while they compile the
# same kernels at start-up. Under torchrun ranks start apart (rank 0 may download the model
# first): torch's default stands.
SPAWNED_GROUP_TIMEOUT = timedelta(seconds=30)
_EVERY_RANK_READY = "bcg/every rank ready"


def spawned_group_store(size: int, rank: int, port: int = 0) -> dist.TCPStore:
    """The rendezvous of a group whose workers rank 0 spawns: rank 0 serves it on a port the
    system picks (read it from `.port`) before it starts them, and they connect to `port`.
    A port found free and bound only later can be taken in between (by another process's
    connection, say), and the group then fails with EADDRINUSE."""
    return dist.TCPStore("127.0.0.1", port, world_size=size, is_master=rank == 0,
                         timeout=SPAWNED_GROUP_TIMEOUT, wait_for_workers=False)


def release_spawned_group(store: dist.Store) -> None:
    """Rank 0, once every worker it spawned is ready to join: let them enter the rendezvous
    together (its timeout then counts from the last, not from each worker's own start)."""
    store.set(_EVERY_RANK_READY, "1")


def wait_for_spawned_group(store: dist.Store) -> None:
    """A spawned worker, ready to join: wait for rank 0's `release_spawned_group`."""
    store.wait([_EVERY_RANK_READY], SPAWNED_START_TIMEOUT)


def init_tensor_parallel(size: int, backend: str, store: dist.Store | None = None,
                         rank: int | None = None, device: torch.device | None = None,
                         step_pipes: tuple[Connection, ...] = ()) -> TensorParallel:
    """Join the process group of `size` ranks and make it current: env-style by default
    (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), or through `store` as `rank` (a group of
    workers that rank 0 spawned: `spawned_group_store`, and their `step_pipes`). On a GPU
    `device` binds the group to it: NCCL's communicator is then created here, not at the
    first collective (inside a step or a graph capture)."""
    global _current
    global _peer_failed
    if size == 1:
        _current = TensorParallel()
        return _current
    refuse_if_abandoned()
    _peer_failed = False  # a late failure report of the group before may have set it
    if not dist.is_initialized():
        options: dict[str, Any] = {"init_method": "env://"}
        if store is not None:
            options = {"store": store, "rank": rank, "world_size": size,
                       "timeout": SPAWNED_GROUP_TIMEOUT}
        if device is not None and device.type == "cuda":
            options["device_id"] = device  # a keyword of init_process_group since torch 2.3
        try:
            dist.init_process_group(backend, **options)
        except BaseException:
            _forget_failed_init()
            raise
    if dist.get_world_size() != size:
        raise ValueError(f"tensor_parallel_size={size} but the process group has "
                         f"{dist.get_world_size()} ranks (WORLD_SIZE): start one process per rank")
    cpu_group = dist.new_group(backend="gloo", timeout=CPU_GROUP_TIMEOUT)
    _current = TensorParallel(dist.get_rank(), size, dist.group.WORLD, cpu_group,
                              step_pipes=step_pipes)
    _connect_collectives(_current, device)
    return _current


def _connect_collectives(tp: TensorParallel, device: torch.device | None) -> None:
    """Run each collective a step uses once: NCCL connects a collective's peers at its first
    call (for the algorithm its size takes), and a peer dying while the host waits in that
    setup inside a step would hang it."""
    nccl = dist.get_backend(tp.group) == "nccl"
    assert not nccl or (device is not None and device.type == "cuda"), "NCCL needs the GPU"
    probe = torch.zeros(tp.size, device=device if nccl else "cpu")
    tp.broadcast(probe)
    dist.all_reduce(probe, group=tp.group)
    tp.all_gather_rows(probe)
    tp.all_to_all(probe, [1] * tp.size, [1] * tp.size)
    if nccl:
        torch.cuda.synchronize(device)


def _forget_failed_init() -> None:
    """A failed `init_process_group` still counts a group: the next attempt in this process
    would name its groups apart from fresh workers' and wait for them forever. Reset the
    count as destroying the group does (torch keeps it private)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count"):
        world.group_count = 0


def launched_rank() -> int | None:
    """This process's RANK when a launcher (torchrun) started it as one of several ranks,
    else None."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    return int(os.environ["RANK"])


def local_rank() -> int:
    """This process's rank on its host (LOCAL_RANK, set by torchrun): its device index."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def destroy_tensor_parallel() -> None:
    """Leave the group (reset every CUDA graph that captured a collective first: destroying
    the group under live graphs hangs)."""
    global _current
    set_custom_all_reduce(None)
    if dist.is_initialized():
        dist.destroy_process_group()
    _current = TensorParallel()


def refuse_if_abandoned() -> None:
    """Raise if this process left a group it could not abort (`abandon_tensor_parallel`)."""
    if _abandoned is not None:
        raise RuntimeError(f"this process cannot join another tensor-parallel group: "
                           f"{_abandoned}; start a new process")


def abandon_tensor_parallel(reason: str) -> None:
    """Forget the group without touching it (its abort did not return: any call into it may
    wait for good); this process refuses to join another one."""
    global _current, _abandoned
    _abandoned = reason
    _current = TensorParallel()
