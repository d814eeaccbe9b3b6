"""Which row counts of the custom all-reduce finish on two GPUs (eager, 5 calls each, rows
in rising order). Run: python hang_probe.py MODE[+MODE...], modes:
  grid    one program per row (else main's grid)
  nccl    an NCCL all-reduce of the same rows after each call, as the tests do
  late    rank 1 sleeps 20 ms before making its inputs, so rank 0 waits in the kernel
          while rank 1 allocates and copies (the tests' ranks draw their random inputs at
          different speeds; a driver call that must wait for the peer's busy GPU would then
          never return)
  free    with late: rank 1 also returns its cached blocks (cudaFree) before its call
  random  random inputs drawn on the CPU, as the tests do
  fused   the fused all-reduce + add + RMSNorm
  fp32    float32 instead of bfloat16
Each line says a row count's 5 calls finished and whether the last one's sums were right;
after a hang nothing more is printed. Session 28 ran an earlier version (plain, grid, and an
NCCL all-reduce once per row count; calls.log) with no hang, where the tests hung at 256
rows."""
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import bcg.kernels.all_reduce_norm as kernel_module
from bcg.distributed.custom_all_reduce import use_custom_all_reduce
from bcg.distributed.parallel_state import init_tensor_parallel, spawned_group_store
from bcg.utils import free_port

ROWS = [1, 7, 64, 128, 132, 133, 200, 256]
MODES = {"grid", "nccl", "late", "late0", "free", "random", "fused", "fp32"}


def main(rank, port, modes):
    if "grid" in modes:
        kernel_module.multiprocessor_count = lambda device: 1 << 20
    dtype = torch.float32 if "fp32" in modes else torch.bfloat16
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    init_tensor_parallel(2, "nccl", spawned_group_store(2, rank, port), rank, device)
    custom = use_custom_all_reduce(True, dtype, device)
    weight = torch.ones(4096, dtype=dtype, device=device)
    for rows in ROWS:
        for call in range(5):
            late = ("late" in modes and rank == 1) or ("late0" in modes and rank == 0)
            if late:
                time.sleep(0.02)
            if "random" in modes:
                generator = torch.Generator().manual_seed(rows * 10 + call + rank)
                x = torch.randn(rows, 4096, generator=generator).to(device, dtype)
            else:
                x = torch.full((rows, 4096), float(rank + 1), dtype=dtype, device=device)
            if late and "free" in modes:
                torch.cuda.empty_cache()
            residual = torch.zeros_like(x)
            if "fused" in modes:
                y, _ = custom.add_rms_norm(x, residual, weight, 1e-6)
                y = residual  # the sum, added to a zero residual
            else:
                y = custom(x)
            expected = x.clone()
            if "nccl" in modes:
                dist.all_reduce(expected)
            else:  # the peer's part, drawn alike
                expected = expected + peer_part(x, rows, call, rank, modes, device, dtype)
            torch.cuda.synchronize()
        right = bool(torch.equal(y, expected.to(dtype)))
        if rank == 0:
            print(f"{'+'.join(modes)} rows {rows} done, sums right: {right}", flush=True)


def peer_part(x, rows, call, rank, modes, device, dtype):
    peer = 1 - rank
    if "random" in modes:
        generator = torch.Generator().manual_seed(rows * 10 + call + peer)
        return torch.randn(rows, 4096, generator=generator).to(device, dtype)
    return torch.full_like(x, float(peer + 1))


if __name__ == "__main__":
    chosen = sys.argv[1].split("+")
    if not set(chosen) <= MODES:
        raise SystemExit(f"unknown modes {sorted(set(chosen) - MODES)}; known: {sorted(MODES)}")
    mp.spawn(main, args=(free_port(), chosen), nprocs=2, join=True)
