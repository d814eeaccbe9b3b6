"""ep2-alltoall prefill at 4096 tokens alone on the machine: breakable with the default limit
(2048: counted rows at 4096), breakable with the limit at 1024 (session 22's default), piecewise."""
import json, os, sys
sys.path.insert(0, "bench")
import model_suite as suite
import bench_moe
shapes = [(1, 4096), (4, 4096), (16, 4096)]
base = bench_moe.SETUPS["ep2-alltoall"].engine_args
runs = [("breakable limit 2048", base, "breakable"),
        ("breakable limit 1024", {**base, "ep_fixed_block_tokens": 1024}, "breakable"),
        ("piecewise", base, "piecewise")]
rows = []
for name, args, mode in runs:
    for row in suite.prefill_rows(args, shapes, [mode]):
        rows.append({"run": name, **row})
        print(name, row["batch"], row["tokens"], f'{row["ms"]:.1f} ms', flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "check4096.json"), "w"), indent=1, default=str)
