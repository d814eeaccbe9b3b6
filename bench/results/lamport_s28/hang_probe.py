"""Which row counts of the custom all-reduce finish on two GPUs (eager, 5 calls each), rows
taken in rising order: python hang_probe.py loop|grid|nccl|nccl-grid (grid: one program per
row; nccl: an NCCL all-reduce of the same rows after each, as tests/test_custom_all_reduce.py
does)."""
import sys

import torch
import torch.multiprocessing as mp

import bcg.kernels.all_reduce_norm as kernel_module
from bcg.distributed.custom_all_reduce import use_custom_all_reduce
from bcg.distributed.parallel_state import init_tensor_parallel, spawned_group_store
from bcg.utils import free_port

ROWS = [1, 32, 64, 100, 128, 132, 133, 160, 200, 256]


def main(rank, port, mode):
    if mode.endswith("grid"):
        kernel_module.multiprocessor_count = lambda device: 1 << 20
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    init_tensor_parallel(2, "nccl", spawned_group_store(2, rank, port), rank, device)
    custom = use_custom_all_reduce(True, torch.bfloat16, device)
    for rows in ROWS:
        x = torch.full((rows, 4096), float(rank + 1), dtype=torch.bfloat16, device=device)
        for _ in range(5):
            y = custom(x)
        if mode.startswith("nccl"):
            torch.distributed.all_reduce(x.clone())
        torch.cuda.synchronize()
        ok = bool((y == 3).all())
        if rank == 0:
            print(f"{mode} rows {rows} done, sums right: {ok}", flush=True)


if __name__ == "__main__":
    mp.spawn(main, args=(free_port(), sys.argv[1]), nprocs=2, join=True)
