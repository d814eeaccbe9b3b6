"""tests/test_custom_all_reduce.py's two-GPU sequence step by step, each rank printing what
it enters and dumping its stack if a step takes over 20 s (session 27's hang)."""
import faulthandler
import os
import sys

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.getcwd())
from tests import test_custom_all_reduce as t  # noqa: E402
from bcg.distributed.custom_all_reduce import MAX_ROWS, row_numel, use_custom_all_reduce  # noqa: E402
from bcg.distributed.parallel_state import set_custom_all_reduce, tensor_parallel  # noqa: E402
from bcg.utils import free_port  # noqa: E402


SYNC = os.environ.get("PROBE_SYNC", "1") == "1"


def step(rank, name, fn, *args):
    print(f"rank {rank} enters {name}", flush=True)
    if SYNC:
        faulthandler.dump_traceback_later(20, exit=True)
    fn(*args)
    if SYNC:
        torch.cuda.synchronize()
        faulthandler.cancel_dump_traceback_later()


def main(rank, port):
    device = t.join_gpu_group(rank, port)
    if not SYNC:
        faulthandler.dump_traceback_later(25, exit=True)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        kernel = use_custom_all_reduce(True, dtype, device)
        width = row_numel(dtype)
        for shape in ((1, 4096), (7, 4096), (MAX_ROWS, 4096), (3, width), (2, 3, 512), (1, 4096)):
            step(rank, f"rows {shape} {dtype}", t.check_rows, kernel, shape, dtype, device, rank)
        for rows in (4, MAX_ROWS):
            step(rank, f"graph {rows} {dtype}", t.check_graph_replays, kernel, rows, dtype, device, rank)
        for rows in (7, 1, MAX_ROWS, 7, 3):
            step(rank, f"fused {rows} {dtype}", t.check_fused_eager, kernel, rows, dtype, device, rank)
        step(rank, f"fused graph {dtype}", t.check_fused_graph_replays, kernel, dtype, device, rank)
        set_custom_all_reduce(None)
    print(f"rank {rank} done", flush=True)
    tensor_parallel().barrier()
    os._exit(0)


if __name__ == "__main__":
    mp.spawn(main, args=(free_port(),), nprocs=2, join=True)
