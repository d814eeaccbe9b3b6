"""ep2-alltoall breakable prefill at 2048 tokens: counted exchange (default, >1024) vs
fixed blocks (--ep-fixed-block-tokens 4096), one engine each, rows as bench_moe's."""
import json, os, sys
sys.path.insert(0, "bench")
import model_suite as suite
import bench_moe
shapes = [(1, 2048), (4, 2048), (16, 2048)]
rows = []
for config in ("ep2-alltoall", "ep2-alltoall-blocks"):
    for row in suite.prefill_rows(bench_moe.SETUPS[config].engine_args, shapes, ["breakable"]):
        rows.append({"config": config, **row})
        print(config, row["batch"], row["tokens"], f'{row["ms"]:.2f} ms', flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "crossover.json"), "w"), indent=1, default=str)
