"""tests/test_custom_all_reduce.py's GPU test with each check printed (the tracing of
../lamport_s28/test_probe.py), and each rank's Python stack written to
$OUT/stack_rank<N>.txt if the rank is still running after DUMP_AFTER seconds (so a hang
shows where each rank's host is). Run from the repository root."""
import faulthandler
import os
import sys

import torch.multiprocessing as mp

sys.path[:0] = [".", "bench/results/lamport_s28"]
import test_probe  # noqa: E402  (wraps the test's checks to print them)
from bcg.utils import free_port  # noqa: E402

DUMP_AFTER = float(os.environ.get("DUMP_AFTER", "40"))


def rank_main(rank, port):
    stack_file = open(os.path.join(os.environ["OUT"], f"stack_rank{rank}.txt"), "w")
    faulthandler.dump_traceback_later(DUMP_AFTER, repeat=True, file=stack_file)
    test_probe.t.gpu_rank_main(rank, port)


if __name__ == "__main__":
    mp.spawn(rank_main, args=(free_port(),), nprocs=2, join=True)
