"""All-reduce latency on 2 GPUs inside CUDA graphs: NCCL against the one-shot and the two-shot
kernels through torch symmetric memory (`--enable-torch-symm-mem`), bf16, message sizes from
one token's hidden state (8 KiB at hidden 4096) to a 2048-token prefill chunk's at hidden
8192 (32 MiB).

Each measurement is a CUDA graph of `CALLS` all-reduces in a row, replayed `REPLAYS` times
between CUDA events on rank 0 (both ranks replay together): µs per all-reduce. Rows carry
`bytes`, `nccl_us`, `one_shot_us` (None above `LARGEST_ONE_SHOT`), `two_shot_us` and each
kernel's ratio to NCCL. The engine's split between them is `bcg.distributed.symm_mem`'s
`ONE_SHOT_MAX_BYTES`.
Back to back, each all-reduce also waits for the other rank to finish its last one, which
costs NCCL more than the kernel: between a model's kernels the order can differ (it does
for qwen3-8b at tp2 on H100s), so the engine's `--enable-torch-symm-mem` is decided by
`bench_tp`'s rows, not by these.
JSON: bench/results/bench_all_reduce.json.
Run: python bench/bench_all_reduce.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, require_cuda, write_results  # noqa: E402

from bcg.distributed.parallel_state import (  # noqa: E402
    destroy_tensor_parallel,
    init_tensor_parallel,
    spawned_group_store,
)
from bcg.distributed.symm_mem import SymmMemAllReduce, use_torch_symm_mem  # noqa: E402
from bcg.utils import free_port  # noqa: E402

SIZES = [2**k for k in range(13, 26)]  # bytes: 8 KiB ... 32 MiB
LARGEST_ONE_SHOT = 4 * 2**20  # the one-shot kernel is measured up to here
CALLS = 32
REPLAYS = 20
DTYPE = torch.bfloat16


def graph_us(all_reduce: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
    """µs per call of `all_reduce(x)`, from a graph of CALLS calls in a row."""
    all_reduce(x)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            x = all_reduce(x)
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    graph.reset()
    return start.elapsed_time(end) * 1e3 / (REPLAYS * CALLS)


def nccl(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def rank_main(rank: int, port: int, out_path: Path) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    init_tensor_parallel(2, "nccl", spawned_group_store(2, rank, port), rank, device)
    try:
        one_shot = use_torch_symm_mem(True, DTYPE, device, max_bytes=max(SIZES),
                                      one_shot_max_bytes=LARGEST_ONE_SHOT)
        if one_shot is None:
            raise SystemExit("bench_all_reduce: symmetric memory did not set up (see the log)")
        two_shot = SymmMemAllReduce(one_shot.buffer, one_shot.group_name, one_shot_max_bytes=0)
        rows = []
        for size in SIZES:
            x = torch.zeros(size // DTYPE.itemsize, dtype=DTYPE, device=device)  # sums stay 0
            row = {"bytes": size, "nccl_us": graph_us(nccl, x), "one_shot_us": None,
                   "two_shot_us": graph_us(two_shot, x)}
            if size <= LARGEST_ONE_SHOT:
                row["one_shot_us"] = graph_us(one_shot, x)
            for kind in ("one_shot", "two_shot"):
                if row[f"{kind}_us"] is not None:
                    row[f"{kind}_over_nccl"] = row[f"{kind}_us"] / row["nccl_us"]
            rows.append(row)
        if rank == 0:
            torch.save(rows, out_path)
    finally:
        destroy_tensor_parallel()


def main() -> None:
    require_cuda("bench_all_reduce")
    if torch.cuda.device_count() < 2:
        raise SystemExit(f"bench_all_reduce: needs 2 GPUs, {torch.cuda.device_count()} visible")
    out_path = Path("/tmp/bench_all_reduce.pt")
    mp.spawn(rank_main, args=(free_port(), out_path), nprocs=2, join=True)
    rows = torch.load(out_path)
    print_table("all-reduce in CUDA graphs, bf16, 2 GPUs (µs per call)",
                ["bytes", "nccl us", "one-shot us", "two-shot us", "one-shot / nccl",
                 "two-shot / nccl"],
                [[r["bytes"], r["nccl_us"], r["one_shot_us"] or "-", r["two_shot_us"],
                  r.get("one_shot_over_nccl", "-"), r["two_shot_over_nccl"]] for r in rows])
    write_results("bench_all_reduce", {"dtype": str(DTYPE), "calls_per_graph": CALLS,
                                       "rows": rows})


if __name__ == "__main__":
    main()
