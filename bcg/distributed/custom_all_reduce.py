"""The custom all-reduce (vLLM's name): decode-sized all-reduces, alone or with the residual
add and the RMSNorm after them, in one kernel of ours (`bcg.kernels.all_reduce_norm`) over
buffers that the ranks of one host map through CUDA IPC, instead of NCCL.

A decode step of a tensor-parallel model all-reduces one hidden state per token twice a
layer; at a few KiB, latency, not the bytes, sets their cost, and NCCL's launch, protocol and
the norm launch after it cost more than the bytes. Each rank writes its rows into every
peer's buffer; each reads its own buffer until every peer's rows have arrived (an empty
slot holds negative zeros, which no sent row carries), sums them and empties the slots.
Messages of up to `MAX_ROWS`
rows of up to `MAX_ROW_BYTES` (a decode batch of 256 at hidden 8192 in bf16) take it; larger
ones (prefill chunks), other dtypes and traced code (`torch.compile`) stay on the group's
backend.

On by default at several ranks on GPUs (`--disable-custom-all-reduce`, vLLM's flag, turns it
off). Its waits have no timeout, so a rank whose peer died mid-step waits in the kernel
until the host releases them (rank 0 does when a worker it spawned fails:
`launcher.Workers`; under torchrun the launcher ends every rank). Where the kernel cannot
run (ranks on several hosts, no peer access between the GPUs, no Triton), the reason is
logged and the group's backend does every all-reduce.
"""

from __future__ import annotations

import inspect
import logging
import os

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from bcg.distributed.parallel_state import (
    TensorParallel,
    launched_rank,
    set_custom_all_reduce,
    tensor_parallel,
)

try:
    from bcg.kernels.all_reduce_norm import (
        PeerRows,
        all_reduce_add_rms_norm,
        all_reduce_rows,
    )
    from bcg.kernels.skinny_linear import MAX_ROWS as PROJECTION_MAX_ROWS
    from bcg.kernels.skinny_linear import projection_all_reduce_add_rms_norm
except ImportError:  # no Triton: no kernel
    PeerRows, PROJECTION_MAX_ROWS = None, 0

logger = logging.getLogger(__name__)

MAX_ROWS = 256  # rows of one call: a decode step of up to 256 sequences
MAX_ROW_BYTES = 16 * 1024  # a row of up to 8192 bf16 (4096 fp32) elements
MAX_RANKS = 8
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FEATURE = "the custom all-reduce (--disable-custom-all-reduce turns it off)"
# Where rebuild_cuda_tensor takes the device to open a shared buffer on.
_STORAGE_DEVICE = list(inspect.signature(rebuild_cuda_tensor).parameters).index("storage_device")


class PeerAllReduce:
    """An all-reduce of `[..., N]` tensors of up to `rows.max_rows` rows of `rows.row_numel`
    elements, and the fused all-reduce + add + RMSNorm, through the ranks' mapped buffers
    (`rows`; None: no Triton, so the kernel takes nothing here, though a subclass may take
    messages for kernels of its own). `mapped` holds those buffers (this rank's and its
    peers') as long as the kernels may touch them."""

    def __init__(self, rows: PeerRows | None, mapped: list[torch.Tensor]) -> None:
        self.rows = rows
        self.mapped: list[torch.Tensor] | None = mapped  # None once released

    def takes(self, x: torch.Tensor) -> bool:
        """Whether `x` goes through the kernel (else the group's backend): contiguous, of
        the buffers' dtype and device, rows and width within the buffers, and outside
        torch.compile. Every rank answers alike: the answer depends on shapes only."""
        self._check_open()
        return (self.rows is not None and x.dim() > 0 and x.is_contiguous()
                and not torch.compiler.is_compiling() and self.rows.takes(_as_rows(x)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, in a new tensor."""
        return all_reduce_rows(_as_rows(x), self.rows).view(x.shape)

    def takes_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether `add_rms_norm` takes `x` (`[rows, hidden]`): as `takes`, with `residual`
        of the same shape, dtype and device, and contiguous. Every rank answers alike."""
        self._check_open()
        return (self.rows is not None and not torch.compiler.is_compiling()
                and self.rows.takes(x) and residual.shape == x.shape
                and residual.dtype == x.dtype and residual.device == x.device
                and x.is_contiguous() and residual.is_contiguous())

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`residual += sum of every rank's x`, then `(rms_norm(residual) * weight,
        residual)`, in one launch."""
        self._check_open()
        return all_reduce_add_rms_norm(x, residual, weight, eps, self.rows)

    def takes_projection_add_rms_norm(self, x: torch.Tensor, weight: torch.Tensor,
                                      residual: torch.Tensor) -> bool:
        """Whether `projection_add_rms_norm` takes the row-parallel projection `x @
        weight.T` (`[rows, K]` by `[N, K]`, rows at most the skinny kernel's) with the
        all-reduce, add and norm after it: as `takes_add_rms_norm` for its output. Every rank
        answers alike. The caller checks that the skinny kernel suits the weight."""
        return (self.takes_add_rms_norm(residual, residual)
                and x.dim() == 2 and x.shape[0] <= PROJECTION_MAX_ROWS and x.is_contiguous()
                and x.dtype == weight.dtype == residual.dtype
                and residual.shape == (x.shape[0], weight.shape[0]))

    def projection_add_rms_norm(self, x: torch.Tensor, weight: torch.Tensor,
                                residual: torch.Tensor, norm_weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`add_rms_norm(x @ weight.T, ...)` in two launches: the projection sends each
        output tile to every rank as it finishes it, and the reduce after it only waits for
        the parts, sums, adds and normalises."""
        self._check_open()
        return projection_all_reduce_add_rms_norm(x, weight, residual, norm_weight, eps,
                                                  self.rows)

    def release_waits(self) -> None:
        """End this rank's waits in the kernel for good (a peer died mid-step): its steps
        then finish, with garbage, instead of waiting forever."""
        if self.rows is not None:
            self.rows.release_waits()

    def release(self) -> None:
        """Drop the buffers once no kernel of this rank may still touch them (a peer's last
        kernel has passed its last wait when ours has; after `release_waits`, the peer is
        gone), and hand shared ones back."""
        if self.mapped is not None:
            torch.cuda.synchronize(self.mapped[0].device)
            self.mapped = None
            torch.cuda.ipc_collect()

    def _check_open(self) -> None:
        if self.mapped is None:
            raise RuntimeError("this all-reduce's engine is closed: build the model again")


def use_custom_all_reduce(enabled: bool, dtype: torch.dtype,
                          device: torch.device) -> PeerAllReduce | None:
    """With `enabled` and several ranks on GPUs, map every rank's buffer on every rank, make
    the kernel the group's custom all-reduce and return it (a collective: every rank calls
    this at the same point, before its model is built); or, on GPUs, log why it cannot run
    here and return None: then the group's backend does every all-reduce."""
    tp = tensor_parallel()
    if not enabled or tp.size == 1 or device.type != "cuda":  # every rank alike
        return None
    reason = unsupported(tp, dtype, device) or rows_unsupported(tp)
    buffer, exports = None, None
    if reason is None:
        try:
            buffer = PeerRows.empty_slots(
                torch.empty(region_numel(tp.size, dtype), dtype=dtype, device=device))
            # One export per peer: each peer's import releases one count of the buffer.
            exports = [None if peer == tp.rank else reduce_tensor(buffer)[1]
                       for peer in range(tp.size)]
            torch.cuda.synchronize(device)  # emptied before any peer can write into it
        except RuntimeError as error:
            reason = f"its buffer cannot be shared ({error})"
    if not agreed(tp, reason is None, reason, FEATURE):
        return None
    every_export: list[list | None] = [None] * tp.size
    dist.all_gather_object(every_export, exports, group=tp.cpu_group)
    mapped, reason = _map_peers(buffer, [e[tp.rank] for e in every_export], tp.rank, device)
    if not agreed(tp, reason is None, reason, FEATURE):
        return None
    rows = peer_rows([b.data_ptr() for b in mapped], tp.rank, dtype, device)
    kernel = PeerAllReduce(rows, mapped)
    set_custom_all_reduce(kernel)
    logger.info("all-reduces of up to %d rows of up to %d KiB in %s run through the custom "
                "all-reduce (with the residual add and RMSNorm in one kernel), larger ones "
                "through %s", MAX_ROWS, MAX_ROW_BYTES // 1024, dtype, dist.get_backend(tp.group))
    return kernel


def row_numel(dtype: torch.dtype) -> int:
    """Elements in a row of the buffers."""
    return MAX_ROW_BYTES // dtype.itemsize


def rows_unsupported(tp: TensorParallel) -> str | None:
    """Why the kernel cannot run over this group, or None."""
    if PeerRows is None:
        return "its kernel needs Triton"
    if tp.size > MAX_RANKS:
        return f"it runs on up to {MAX_RANKS} ranks"
    return None


def region_numel(world_size: int, dtype: torch.dtype) -> int:
    """Elements of the region each rank maps for the kernel: its slots."""
    return PeerRows.region_numel(world_size, row_numel(dtype), MAX_ROWS)


def peer_rows(bases: list[int], rank: int, dtype: torch.dtype, device: torch.device) -> PeerRows:
    """The kernel's view of every rank's region (`bases`: their addresses, as mapped here)."""
    return PeerRows(bases, rank, row_numel(dtype), MAX_ROWS, dtype, device)


def _map_peers(buffer: torch.Tensor, every_export: list[tuple], rank: int,
               device: torch.device) -> tuple[list[torch.Tensor] | None, str | None]:
    """Every rank's buffer, opened here (this rank's own as it is): (them, None), or (None,
    why not)."""
    mapped = []
    try:
        for peer, exported in enumerate(every_export):
            mapped.append(buffer if peer == rank else _open_on(exported, device))
    except Exception as error:  # noqa: BLE001 (every rank must reach the agreement after)
        return None, f"the ranks could not map each other's buffers ({error})"
    return mapped, None


def _open_on(exported: tuple, device: torch.device) -> torch.Tensor:
    """A peer's exported buffer (torch's CUDA IPC arguments), mapped into this rank's device
    context: the kernels address it from here."""
    arguments = list(exported)
    arguments[_STORAGE_DEVICE] = device.index  # open the handle from our own device
    return rebuild_cuda_tensor(*arguments)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    return x.view(-1, x.shape[-1])


def unsupported(tp: TensorParallel, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why this rank cannot run a kernel that reads and writes peers' memory, or None."""
    if device.type != "cuda":
        return f"it needs CUDA devices, and this rank runs on {device}"
    if dtype not in DTYPES:
        return f"the kernels sum {', '.join(str(d) for d in DTYPES)}, not {dtype}"
    # torchrun's count of this host's ranks (rank 0's own workers are all on its host)
    if launched_rank() is not None and int(os.environ.get("LOCAL_WORLD_SIZE", tp.size)) < tp.size:
        return "the ranks span several hosts, and the kernel reads peers' memory directly"
    if torch.cuda.device_count() < tp.size:
        return (f"this rank sees {torch.cuda.device_count()} GPUs, not one per rank (each "
                "rank's GPU is the one of its index)")
    index = torch.cuda.current_device() if device.index is None else device.index
    if not all(torch.cuda.can_device_access_peer(index, peer)
               for peer in range(tp.size) if peer != index):
        return "this GPU cannot read the other ranks' GPUs directly (no peer access)"
    return None


def agreed(tp: TensorParallel, ok: bool, reason: str | None, feature: str) -> bool:
    """Whether every rank is `ok`; if not, warn why `feature` (its name or flag) does not
    take effect (this rank's reason, if it has one)."""
    if tp.min_over_ranks(int(ok)):
        return True
    logger.warning("%s does not take effect: %s", feature,
                   reason or "another rank cannot run it")
    return False
