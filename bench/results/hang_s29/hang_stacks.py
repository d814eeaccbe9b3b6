"""tests/test_custom_all_reduce.py's GPU test with each check printed, and each rank's Python
stack written to $OUT/stack_rank<N>.txt if the rank is still running after DUMP_AFTER
seconds (so a hang shows where each rank's host is)."""
import faulthandler
import os
import sys

import torch.multiprocessing as mp

sys.path.insert(0, ".")
import tests.test_custom_all_reduce as t  # noqa: E402
from bcg.utils import free_port  # noqa: E402

DUMP_AFTER = float(os.environ.get("DUMP_AFTER", "40"))

for name in ("check_rows", "check_graph_replays", "check_fused_eager", "check_fused_graph_replays"):
    def traced(*args, _check=getattr(t, name), _name=name):
        shown = [a if isinstance(a, (int, tuple)) else str(a).split("(")[0][:20] for a in args[1:]]
        print(f"{_name} {shown} ...", flush=True)
        result = _check(*args)
        print(f"{_name} {shown} done", flush=True)
        return result
    setattr(t, name, traced)


def rank_main(rank, port):
    stack_file = open(os.path.join(os.environ["OUT"], f"stack_rank{rank}.txt"), "w")
    faulthandler.dump_traceback_later(DUMP_AFTER, repeat=True, file=stack_file)
    t.gpu_rank_main(rank, port)


if __name__ == "__main__":
    mp.spawn(rank_main, args=(free_port(),), nprocs=2, join=True)
