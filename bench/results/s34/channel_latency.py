"""Rank 0's send time and the time until a worker has the plan, for the group's step channel
(gloo broadcasts) and a pipe's, two processes on this host, a plan of 6.5 KB (a batch of 64)
and of 64 KB; the worker stamps its arrival into shared memory.
python bench/results/s34/channel_latency.py [steps]"""

import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from bcg.distributed.parallel_state import (  # noqa: E402
    destroy_tensor_parallel,
    init_tensor_parallel,
    spawned_group_store,
    tensor_parallel,
)
from bcg.distributed.step_channel import GroupStepChannel, PipeStepChannel  # noqa: E402

SIZES = (6500, 65536)


def worker(kind, port, pipe, arrived, steps):
    torch.set_num_threads(1)
    init_tensor_parallel(2, "gloo", spawned_group_store(2, 1, port), 1)
    channel = PipeStepChannel((pipe,)) if kind == "pipe" else GroupStepChannel(tensor_parallel())
    for index in range(steps * len(SIZES)):
        channel.receive()
        arrived[index] = time.perf_counter()
    destroy_tensor_parallel()


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    for kind in ("gloo", "pipe"):
        port = 29600 + (kind == "pipe")
        receiver, sender = mp.Pipe(duplex=False)
        arrived = mp.Array("d", steps * len(SIZES), lock=False)
        process = mp.Process(target=worker, args=(kind, port, receiver, arrived, steps))
        process.start()
        torch.set_num_threads(1)
        init_tensor_parallel(2, "gloo", spawned_group_store(2, 0, port), 0)
        channel = PipeStepChannel((sender,)) if kind == "pipe" else GroupStepChannel(tensor_parallel())
        index = 0
        for size in SIZES:
            payload = bytes(size)
            sends, latencies = [], []
            for _ in range(steps):
                start = time.perf_counter()
                channel.send(payload)
                sends.append(time.perf_counter() - start)
                while arrived[index] == 0:
                    pass
                latencies.append(arrived[index] - start)
                index += 1
                time.sleep(0.002)  # the rest of a step
            print(f"{kind} {size:6d} B: send median {statistics.median(sends) * 1e6:7.1f} us, "
                  f"p99 {sorted(sends)[int(0.99 * steps)] * 1e6:7.1f}; at the worker median "
                  f"{statistics.median(latencies) * 1e6:7.1f} us, p99 "
                  f"{sorted(latencies)[int(0.99 * steps)] * 1e6:7.1f}", flush=True)
        process.join()
        destroy_tensor_parallel()


if __name__ == "__main__":
    main()
