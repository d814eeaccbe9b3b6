"""Where the custom all-reduce stops on two GPUs: back-to-back calls, eagerly and in a CUDA
graph, at several row counts; a short timeout turns a hang into an error (session 27)."""
import os
import sys
import time

import torch
import torch.multiprocessing as mp

from bcg.distributed.custom_all_reduce import use_custom_all_reduce
from bcg.distributed.parallel_state import init_tensor_parallel, spawned_group_store, tensor_parallel
from bcg.utils import free_port


def main(rank, port, rows_list, mode):
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    init_tensor_parallel(2, "nccl", spawned_group_store(2, rank, port), rank, device)
    kernel = use_custom_all_reduce(True, torch.bfloat16, device)
    from bcg.kernels.all_reduce_norm import _launch
    for rows in rows_list:
        x = torch.ones(rows, 4096, dtype=torch.bfloat16, device=device)
        tensor_parallel().barrier()
        start = time.monotonic()
        try:
            if mode == "eager":
                y = kernel(kernel(kernel(x)) * 0.5)
            else:
                kernel(x)
                torch.cuda.synchronize()
                tensor_parallel().barrier()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    y = kernel(kernel(kernel(x)) * 0.5)
                tensor_parallel().barrier()
                graph.replay()
            torch.cuda.synchronize()
            print(f"rank {rank} {mode} rows {rows}: ok {y[0, 0].item()} in "
                  f"{time.monotonic() - start:.2f} s", flush=True)
        except RuntimeError as error:
            print(f"rank {rank} {mode} rows {rows}: FAILED after {time.monotonic() - start:.1f} s: "
                  f"{str(error)[:200]}", flush=True)
            os._exit(1)
    compiled = list(_launch.compiled.values())
    for c in compiled:
        print(f"rank {rank}: n_regs {c.n_regs} n_spills {c.n_spills} shared {c.metadata.shared}"
              f" warps {c.metadata.num_warps}", flush=True)
    tensor_parallel().barrier()
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("BCG_ALL_REDUCE_TIMEOUT", "5")
    mode = sys.argv[1]
    rows_list = [int(r) for r in sys.argv[2:]]
    mp.spawn(main, args=(free_port(), rows_list, mode), nprocs=2, join=True)
