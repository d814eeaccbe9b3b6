"""This process's place in the tensor-parallel group, and the collectives layers call.

One process per device; `init_tensor_parallel` joins the group with torch.distributed's
env-style initialisation (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), so the same code
starts under `torchrun` or from the engine's own launcher: NCCL on GPUs, gloo on the CPU
(so tests of several ranks run anywhere). Layers read the group when they are built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed group; None for a single process

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
        """Sum `x` over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

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


def tensor_parallel() -> TensorParallel:
    return _current


def init_tensor_parallel(size: int, backend: str) -> TensorParallel:
    """Join the process group of `size` ranks (env-style) and make it current."""
    global _current
    if size == 1:
        _current = TensorParallel()
        return _current
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://")
    if dist.get_world_size() != size:
        raise ValueError(f"tensor_parallel_size={size} but the process group has "
                         f"{dist.get_world_size()} ranks (WORLD_SIZE): start one process per rank")
    _current = TensorParallel(dist.get_rank(), size, dist.group.WORLD)
    return _current


def destroy_tensor_parallel() -> None:
    """Leave the group (reset every CUDA graph that captured a collective first: destroying
    the group under live graphs hangs)."""
    global _current
    if dist.is_initialized():
        dist.destroy_process_group()
    _current = TensorParallel()
