"""A process-wide pool that lets graph runners share identical static input buffers.

Runners capture graphs that read their inputs from fixed addresses. Two runners that
need the same buffer (same name, size, dtype and device) can read from one allocation
because only one of them replays at a time. The key holds everything that defines the
allocation, so who registers first never changes what is shared, and buffers of
different sizes never alias.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

_PoolKey = tuple[str, int, torch.dtype, torch.device]
_pool: dict[_PoolKey, torch.Tensor] = {}


def share_buffer(
    name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """Return the pooled zero-initialised buffer for `(name, numel, dtype, device)`, viewed
    as `shape`; the first request allocates it, identical later requests get its storage."""
    device = normalize_device(device)
    numel = math.prod(shape)
    key = (name, numel, dtype, device)
    if key not in _pool:
        _pool[key] = torch.zeros(numel, dtype=dtype, device=device)
    return _pool[key].view(tuple(shape))


def clear_shared_buffers() -> None:
    """Drop every pooled buffer (runners that hold one keep it alive); later requests
    allocate afresh. Call it when tearing down all runners, or between tests."""
    _pool.clear()


def normalize_device(device: torch.device | str) -> torch.device:
    """`cuda` and `cuda:<current>` name the same memory; give them one spelling."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
