"""ep2-alltoall prefill at 4096 tokens (counted exchange): eager, breakable, piecewise, for
the checkout first on PYTHONPATH."""
import json, os, sys
sys.path.insert(0, "bench")
import model_suite as suite
import bench_moe
import bcg
label = sys.argv[1]
shapes = [(1, 4096), (4, 4096), (16, 4096)]
rows = []
for row in suite.prefill_rows(bench_moe.SETUPS["ep2-alltoall"].engine_args, shapes):
    rows.append({"checkout": label, **row})
    print(label, row["mode"], row["batch"], row["tokens"], f'{row["ms"]:.1f} ms', flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), f"ab4096_{label}.json"), "w"), indent=1, default=str)
