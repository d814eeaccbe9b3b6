"""Where tests/test_custom_all_reduce.py's GPU test stops: its checks, each printed before and
after, on rank 0 and rank 1 (spawned children re-run this module's top level)."""
import sys

import torch.multiprocessing as mp

sys.path.insert(0, ".")
import tests.test_custom_all_reduce as t  # noqa: E402
from bcg.utils import free_port  # noqa: E402

for name in ("check_rows", "check_graph_replays", "check_fused_eager", "check_fused_graph_replays"):
    def traced(*args, _check=getattr(t, name), _name=name):
        shown = [a if isinstance(a, (int, tuple)) else str(a).split("(")[0][:20] for a in args[1:]]
        print(f"{_name} {shown} ...", flush=True)
        result = _check(*args)
        print(f"{_name} done", flush=True)
        return result
    setattr(t, name, traced)

if __name__ == "__main__":
    mp.spawn(t.gpu_rank_main, args=(free_port(),), nprocs=2, join=True)
