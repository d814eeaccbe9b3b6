"""All-reduces through torch's symmetric memory (`--enable-torch-symm-mem`, SGLang's flag):
kernels in which every rank reads the other ranks' buffers over NVLink, instead of NCCL.

A decode step of a tensor-parallel model all-reduces one hidden state per token twice a
layer; at a few KiB latency, not the bytes, sets their cost. Each rank copies its part into
a buffer every rank has mapped, the ranks meet at a barrier of device-side signals, and
each sums all the buffers into its output: the one-shot kernel, one launch, capturable in
any CUDA graph. Larger messages (a batch of 256 decodes at hidden 4096 is 2 MiB, a prefill
chunk 16 MiB) take the two-shot kernel: each rank sums its 1/N of the message from every
buffer, then gathers the others' sums, so it reads the message about twice, as NCCL's ring
does, but in one launch with no pipeline of steps. Beyond the buffer, other dtypes and
traced code (`torch.compile`) stay on NCCL. Where an all-reduce of up to 256 rows feeds the
residual add and the RMSNorm (the row-parallel projections and experts of a decode step),
the custom all-reduce's Triton kernel does all three (`bcg.kernels.all_reduce_norm`) over a
second region of the same buffer.

Off by default: the barriers wait without a timeout: a rank that dies mid-step leaves the
others spinning in the kernel (NCCL's abort cannot stop it), so they must be killed. The
README's Tensor parallelism section has what it gains.
"""

from __future__ import annotations

import logging

import torch

from bcg.distributed.custom_all_reduce import (
    MAX_ROWS,
    PeerAllReduce,
    PeerRows,
    agreed,
    peer_rows,
    region_numel,
    rows_unsupported,
    unsupported,
)
from bcg.distributed.parallel_state import TensorParallel, set_custom_all_reduce, tensor_parallel

logger = logging.getLogger(__name__)

# Messages up to this many bytes take the one-shot kernel: every rank reads all of every
# other rank's part, so past a few hundred KiB the two-shot kernel moves fewer bytes.
ONE_SHOT_MAX_BYTES = 512 * 1024
# Larger ones up to this (the buffer's size) take the two-shot kernel: a 2048-token prefill
# chunk of a hidden size up to 8192 in bf16 fits.
MAX_BYTES = 32 * 2**20
FEATURE = "--enable-torch-symm-mem"
ALIGNMENT = 16  # the kernels' widest loads; the buffer and the input must agree on it
DTYPES = (torch.bfloat16, torch.float32)  # what the kernels sum
TWO_SHOT_WORLD_SIZES = (2, 4, 8)  # the only ones torch's two-shot kernel is built for
ONE_SHOT = "symm_mem::one_shot_all_reduce_copy_out"
TWO_SHOT = "symm_mem::two_shot_all_reduce_out"


class SymmMemAllReduce(PeerAllReduce):
    """An all-reduce of tensors of its buffer's dtype, up to the buffer's size, over the
    ranks of the group named `group_name`, through that buffer (mapped by every rank): the
    one-shot kernel up to `one_shot_max_bytes`, the two-shot kernel above; and the fused
    all-reduce + add + RMSNorm of `PeerAllReduce` over `fused_rows` (None: not fused).
    `release_waits` ends the fused kernel's waits only: torch's kernels wait for a dead peer
    for good."""

    def __init__(self, buffer: torch.Tensor, group_name: str,
                 one_shot_max_bytes: int = ONE_SHOT_MAX_BYTES,
                 fused_rows: PeerRows | None = None) -> None:
        super().__init__(fused_rows, [buffer])
        self.group_name = group_name
        self.max_numel = buffer.numel()
        self.one_shot_numel = one_shot_max_bytes // buffer.element_size()

    def takes(self, x: torch.Tensor) -> bool:
        """Whether `x` goes through these kernels (else NCCL): the buffer's device and dtype,
        at most the buffer's size, contiguous, starting 16 bytes into its storage
        (allocations are aligned) and not traced by torch.compile (Inductor lowers NCCL's
        all-reduce itself).
        Every rank answers alike: the answer depends on shapes and offsets only."""
        # Checked first: a traced tensor has no storage to look at.
        if torch.compiler.is_compiling():
            return False
        self._check_open()
        return (x.device == self.buffer.device and x.dtype == self.buffer.dtype
                and 0 < x.numel() <= self.max_numel and x.is_contiguous()
                and (x.numel() * x.element_size()) % ALIGNMENT == 0
                and (x.storage_offset() * x.element_size()) % ALIGNMENT == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, in a new tensor."""
        out = torch.empty_like(x)
        part = self.buffer[: x.numel()]
        if x.numel() <= self.one_shot_numel:
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(
                part, x.view(-1), "sum", self.group_name, out.view(-1))
        else:  # the two-shot kernel reads the buffer only: x goes there first
            part.copy_(x.view(-1))
            torch.ops.symm_mem.two_shot_all_reduce_out(part, "sum", self.group_name,
                                                       out.view(-1))
        return out

    @property
    def buffer(self) -> torch.Tensor:
        """The flat buffer of torch's kernels (this rank's, mapped by every rank)."""
        self._check_open()
        return self.mapped[0]


def use_torch_symm_mem(enabled: bool, dtype: torch.dtype, device: torch.device,
                       max_bytes: int = MAX_BYTES,
                       one_shot_max_bytes: int = ONE_SHOT_MAX_BYTES) -> SymmMemAllReduce | None:
    """With `enabled` and several ranks, set the all-reduce of messages up to `max_bytes`
    (one-shot up to `one_shot_max_bytes`) up on every rank and return it (a collective:
    every rank calls this at the same point, before its model is built); or log why it
    cannot run here and return None:
    then the group's backend does every all-reduce."""
    tp = tensor_parallel()
    if not enabled or tp.size == 1:
        if enabled:
            logger.info("--enable-torch-symm-mem has no effect on a single rank")
        return None
    if tp.size not in TWO_SHOT_WORLD_SIZES:  # the one-shot kernel only; larger go to NCCL
        max_bytes = min(max_bytes, one_shot_max_bytes)
    reason = _unsupported(tp, dtype, device)
    # After the all-reduce's buffer: the fused kernel's region (its slots).
    fused = rows_unsupported(tp) is None
    total_bytes = max_bytes + (region_numel(tp.size, dtype) * dtype.itemsize if fused else 0)
    buffer, reason = _allocate(total_bytes, dtype, device) if reason is None else (None, reason)
    # Every rank goes on to the rendezvous, or none: it waits for all of them.
    if agreed(tp, buffer is not None, reason, FEATURE):
        if fused:
            PeerRows.empty_slots(buffer[max_bytes // buffer.element_size():])
        torch.cuda.synchronize(device)  # emptied before any peer can write into it
        handle, reason = _rendezvous(buffer, tp.group.group_name)
        if agreed(tp, reason is None, reason, FEATURE):
            fused_rows = _fused_rows(buffer, handle, max_bytes) if fused else None
            all_reduce_part = buffer[: max_bytes // buffer.element_size()]
            kernel = SymmMemAllReduce(all_reduce_part, tp.group.group_name, one_shot_max_bytes,
                                      fused_rows)
            set_custom_all_reduce(kernel)
            logger.info("all-reduces of %s run through torch symmetric memory (one-shot up to "
                        "%d KiB, two-shot up to %d KiB), larger ones through NCCL%s", dtype,
                        one_shot_max_bytes // 1024, max_bytes // 1024,
                        f"; with the residual add and RMSNorm in one kernel up to {MAX_ROWS} "
                        "rows" if fused_rows else "")
            return kernel
    return None


def _fused_rows(buffer: torch.Tensor, handle: object, region_at: int) -> PeerRows:
    """The fused kernel's view of every rank's region, `region_at` bytes into its buffer.
    The buffer starts at the same offset into every rank's mapping."""
    offset = buffer.data_ptr() - handle.buffer_ptrs[handle.rank]
    return peer_rows([base + offset + region_at for base in handle.buffer_ptrs], handle.rank,
                     buffer.dtype, buffer.device)


def _unsupported(tp: TensorParallel, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why this rank cannot use the kernels, or None."""
    if device.type != "cuda":
        return unsupported(tp, dtype, device)
    if dtype not in DTYPES:
        return f"the kernels sum bfloat16 and float32, not {dtype}"
    for op in (ONE_SHOT, TWO_SHOT) if tp.size in TWO_SHOT_WORLD_SIZES else (ONE_SHOT,):
        if not _has_cuda_kernel(op):
            return f"this torch ({torch.__version__}) has no CUDA kernel for {op}"
    return unsupported(tp, dtype, device)


def _has_cuda_kernel(op: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
    except RuntimeError:  # a torch without the op at all
        return False


def _allocate(max_bytes: int, dtype: torch.dtype,
              device: torch.device) -> tuple[torch.Tensor | None, str | None]:
    """The buffer, or why it cannot be had. Not from symm_mem.empty's process-wide pool,
    which keeps a freed block and its peers' mappings: a later engine would get them back
    and skip the exchange that its fresh workers wait in."""
    from torch.distributed import _symmetric_memory as symm_mem  # only when asked for

    numel = max_bytes // dtype.itemsize
    try:
        return symm_mem._SymmetricMemory.empty_strided_p2p((numel,), (1,), dtype, device), None
    except RuntimeError as error:
        return None, f"symmetric memory cannot be allocated here ({error})"


def _rendezvous(buffer: torch.Tensor, group_name: str) -> tuple[object, str | None]:
    """Map every rank's buffer on every rank: (the handle, None), or (None, why not)."""
    from torch.distributed import _symmetric_memory as symm_mem

    try:
        return symm_mem.rendezvous(buffer, group_name), None
    except RuntimeError as error:
        return None, f"the ranks could not map each other's buffers ({error})"
