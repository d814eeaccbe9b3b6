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
Session 28 found the tests hanging at 256 rows and this probe (grid, nccl, plain) not."""
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
            if "late" in modes and rank == 1:
                time.sleep(0.02)
            if "random" in modes:
                generator = torch.Generator().manual_seed(rows * 10 + call + rank)
                x = torch.randn(rows, 4096, generator=generator).to(device, dtype)
            else:
                x = torch.full((rows, 4096), float(rank + 1), dtype=dtype, device=device)
            if "free" in modes and rank == 1:
                torch.cuda.empty_cache()
            if "fused" in modes:
                y, _ = custom.add_rms_norm(x, torch.zeros_like(x), weight, 1e-6)
            else:
                y = custom(x)
            if "nccl" in modes:
                dist.all_reduce(x.clone())
            torch.cuda.synchronize()
        if rank == 0:
            print(f"{'+'.join(modes)} rows {rows} done, finite: {bool(y.isfinite().all())}",
                  flush=True)


if __name__ == "__main__":
    mp.spawn(main, args=(free_port(), sys.argv[1].split("+")), nprocs=2, join=True)
