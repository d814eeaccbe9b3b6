"""Four and eight GPUs, bf16, dummy weights: qwen3-32b at tp4; qwen3-235b-a22b at tp8 and at
ep8 with either expert dispatch (`--ep-dispatch allreduce` / `alltoall`).

Rows, each measured as `bench/model_suite.py` describes: prefill rows (eager, breakable,
piecewise), decode engine step at batch 1, 8 and 64, bench_offline's output tok/s, and the
graphs part: seconds until `LLM(...)` is ready with every graph captured and rank 0's graph
pools, at the model's depth and at a quarter of it. Targets (the four-and-eight-GPU issue):
breakable ≤ piecewise on every prefill row; start-up ≤ 10 s at tp8 for the 235B shapes; the
graph pool per rank O(1) in layers (the deep model's pools over the shallow one's ≈ 1).
JSON: bench/results/bench_multi_gpu.json (rows carry `config`, `tp`, and `gpus`: those
visible).
Run: python bench/bench_multi_gpu.py [--configs ...] [--parts prefill decode offline graphs]
(each part or configuration can run alone; the JSON keeps the others' earlier rows).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_suite as suite  # noqa: E402

DENSE, MOE = "qwen3-32b", "qwen3-235b-a22b"
EP8 = {"model": MOE, "tensor_parallel_size": 8, "enable_expert_parallel": True}
ALL = (*suite.PARTS, suite.GRAPHS_PART)
SETUPS = {
    "qwen3-32b-tp4": suite.Setup({"model": DENSE, "tensor_parallel_size": 4}, ALL),
    "qwen3-235b-tp8": suite.Setup({"model": MOE, "tensor_parallel_size": 8}, ALL),
    "qwen3-235b-ep8-allreduce": suite.Setup({**EP8, "ep_dispatch": "allreduce"}, ALL),
    "qwen3-235b-ep8-alltoall": suite.Setup({**EP8, "ep_dispatch": "alltoall"}, ALL),
}
STARTUP_TARGET_S = 10.0


def report(rows: list[dict]) -> None:
    suite.print_tables(rows)
    for config in SETUPS:
        suite.print_target(f"{config}: graph pools at full depth / at a quarter",
                           suite.pool_growth(rows, config), "≈ 1: O(1) in layers")
    for config, setup in SETUPS.items():
        if setup.gpus == 8:
            depths = suite.deepest_and_shallowest(rows, config)
            suite.print_target(f"{config}: start-up s, every graph captured",
                               depths[0]["startup_s"] if depths else None,
                               f"≤ {STARTUP_TARGET_S:g}")


if __name__ == "__main__":
    suite.bench_main("bench_multi_gpu", __doc__, SETUPS,
                     {4: ["qwen3-32b-tp4"], 8: list(SETUPS)}, report)
