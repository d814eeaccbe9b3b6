"""Small all-reduces through torch's symmetric memory (`--enable-torch-symm-mem`, SGLang's
flag): a one-shot kernel in which every rank reads every other rank's buffer over NVLink and
sums, instead of NCCL.

A decode step of a tensor-parallel model all-reduces one hidden state per token twice a
layer; at a few KiB NCCL's latency, not the bytes, sets their cost (on two H100s qwen3-8b's
tp2 step at batch 1 spends 0.74 ms more beyond its weight reads than tp1's, about 10 µs per
all-reduce if they take it all). Each rank copies its part into a buffer every rank has
mapped, the ranks meet at a barrier of device-side signals, and each sums all the buffers
into its output: one launch, capturable in any CUDA graph. Larger messages, other dtypes
and traced code (`torch.compile`) stay on NCCL.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from bcg.distributed.parallel_state import set_custom_all_reduce, tensor_parallel

logger = logging.getLogger(__name__)

# Messages up to this many bytes take the one-shot kernel: every rank reads all of every
# other rank's part, so past a few hundred KiB NCCL's ring moves fewer bytes per rank.
MAX_BYTES = 512 * 1024
ALIGNMENT = 16  # the kernel's widest loads; the buffer and the input must agree on it


class SymmMemAllReduce:
    """A one-shot all-reduce of `dtype` tensors up to `max_bytes` over the ranks of `group`,
    through one symmetric buffer every rank has mapped."""

    def __init__(self, buffer: torch.Tensor, group_name: str, max_bytes: int) -> None:
        self.buffer = buffer  # flat, `dtype`, allocated by symm_mem.empty and rendezvoused
        self.group_name = group_name
        self.max_numel = max_bytes // buffer.element_size()

    def takes(self, x: torch.Tensor) -> bool:
        """Whether `x` goes through this kernel (else NCCL): the buffer's device and dtype, at
        most `max_bytes`, contiguous, 16-byte aligned, and not being traced by torch.compile
        (Inductor lowers NCCL's all-reduce itself)."""
        # Checked first: a traced tensor has no data pointer to look at.
        if torch.compiler.is_compiling():
            return False
        return (x.device == self.buffer.device and x.dtype == self.buffer.dtype
                and 0 < x.numel() <= self.max_numel and x.is_contiguous()
                and (x.numel() * x.element_size()) % ALIGNMENT == 0
                and x.data_ptr() % ALIGNMENT == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, in a new tensor."""
        out = torch.empty_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(
            self.buffer[: x.numel()], x.view(-1), "sum", self.group_name, out.view(-1))
        return out

    def release(self) -> None:
        """Let the buffer go once no kernel may still read it (every rank's graphs are gone)."""
        torch.cuda.synchronize(self.buffer.device)
        del self.buffer


def use_torch_symm_mem(enabled: bool, dtype: torch.dtype, device: torch.device,
                       max_bytes: int = MAX_BYTES) -> None:
    """With `enabled` and several ranks, set the one-shot all-reduce of messages up to
    `max_bytes` up on every rank (a collective: every rank calls this at the same point,
    before its model is built), or log why it cannot run here: then the group's backend does
    every all-reduce."""
    tp = tensor_parallel()
    if not enabled or tp.size == 1:
        if enabled:
            logger.info("--enable-torch-symm-mem has no effect on a single rank")
        return
    from torch.distributed import _symmetric_memory as symm_mem  # only when asked for

    reason = _unsupported(device)
    buffer = None
    if reason is None:
        try:
            buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
        except RuntimeError as error:
            reason = f"symmetric memory cannot be allocated here ({error})"
    # Every rank goes on to the rendezvous, or none: it waits for all of them.
    if tp.min_over_ranks(int(buffer is not None)) == 0:
        logger.warning("--enable-torch-symm-mem: %s; all-reduces stay on %s",
                       reason or "another rank cannot use symmetric memory",
                       dist.get_backend(tp.group))
        return
    group_name = tp.group.group_name
    symm_mem.rendezvous(buffer, group_name)
    logger.info("all-reduces of %s up to %d KiB run through torch symmetric memory "
                "(one-shot), larger ones through NCCL", dtype, max_bytes // 1024)
    set_custom_all_reduce(SymmMemAllReduce(buffer, group_name, max_bytes))


def _unsupported(device: torch.device) -> str | None:
    """Why this rank cannot use the kernel, or None."""
    if device.type != "cuda":
        return f"it needs CUDA devices, and this rank runs on {device}"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
        return f"this torch ({torch.__version__}) has no symm_mem one_shot_all_reduce_copy_out"
    return None
