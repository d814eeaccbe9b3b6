"""Graph memory and start-up: each runner's graph pool and capture seconds, the KV cache it
leaves, and the seconds until `LLM(...)` is ready, per model and prefill bucket limit.

Every configuration runs in a fresh process (dummy weights, bf16, default graphs: full decode
and breakable prefill), twice: the first run fills Triton's disk cache, the second is the
row (a process whose Triton cache is warm). `ready_s` is `LLM(...)` alone, imports
excluded. The qwen3-8b shape is also swept over 9, 18 and 36 layers: a pool that does not
grow with depth stays flat. `--code DIR` measures another checkout of bcg (e.g. the commit
before a change) with the same workloads, for a before/after table.
Run: python bench/bench_memory.py [--code DIR] [--label NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, require_cuda, write_results  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# (preset, layers or None for the preset's own, max_num_batched_tokens)
CONFIGS = [
    ("qwen3-0.6b", None, 4096),
    ("qwen3-8b", None, 2048),
    ("qwen3-8b", None, 4096),
    ("qwen3-8b", 9, 2048),
    ("qwen3-8b", 18, 2048),
]
GPU_MEMORY_UTILIZATION = 0.85

# Runs in the child process: builds the engine from the checkout on sys.path[0] and prints
# one JSON line. A layer count other than the preset's is a temporary preset.
WORKER = """
import json, logging, sys, time
import torch
from bcg.engine.llm import LLM
from bcg.models.presets import PRESETS
model, layers, max_tokens, util = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
if layers != "None":
    PRESETS[f"{model}-{layers}l"] = {**PRESETS[model], "num_hidden_layers": int(layers)}
    model = f"{model}-{layers}l"
startup_log = []  # the -v breakdown: each start-up step and each runner's warm-up/capture


class Keep(logging.Handler):
    def emit(self, record):
        startup_log.append(record.getMessage())


for name in ("bcg.startup", "bcg.runner.graph_runner"):
    logging.getLogger(name).addHandler(Keep())
    logging.getLogger(name).setLevel(logging.INFO)
start = time.perf_counter()
llm = LLM(model, load_format="dummy", max_num_batched_tokens=max_tokens,
          gpu_memory_utilization=util)
ready_s = time.perf_counter() - start
runner = llm.engine.runner
print("RESULT " + json.dumps({
    "ready_s": ready_s,
    "num_layers": runner.model_config.num_hidden_layers,
    "kv_tokens": runner.num_kv_blocks * runner.block_size,
    "runners": [{"runner": r.kind, "pool_gib": r.pool_bytes / 2**30,
                 "capture_s": r.capture_seconds} for r in runner.graph_runners],
    "startup_log": startup_log,
}))
"""


def run_config(code: Path, model: str, layers: int | None, max_tokens: int) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{code}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    args = [sys.executable, "-c", WORKER, model, str(layers), str(max_tokens),
            str(GPU_MEMORY_UTILIZATION)]
    # cwd too: `python -c` puts the working directory first on sys.path.
    done = subprocess.run(args, env=env, cwd=code, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{model} ({layers} layers, {max_tokens} tokens) failed:\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", type=Path, default=REPO, help="checkout of bcg to measure")
    parser.add_argument("--label", default="", help="suffix of the JSON name (e.g. 'before')")
    parser.add_argument("--runs", type=int, default=2, help="runs per config; the last counts")
    args = parser.parse_args()
    require_cuda("bench_memory")
    rows, models = [], []
    for model, layers, max_tokens in CONFIGS:
        for _ in range(args.runs):
            result = run_config(args.code.resolve(), model, layers, max_tokens)
        models.append({"model": model, "num_layers": result["num_layers"],
                       "max_tokens": max_tokens, "ready_s": result["ready_s"],
                       "kv_tokens": result["kv_tokens"], "startup_log": result["startup_log"]})
        print("\n".join(result["startup_log"]), flush=True)
        rows += [{"model": model, "num_layers": result["num_layers"], "max_tokens": max_tokens,
                  **r} for r in result["runners"]]
        print(f"{model} x{result['num_layers']} @{max_tokens}: "
              f"{ {k: v for k, v in result.items() if k != 'startup_log'} }", flush=True)
    print_table(
        f"graph pools and start-up ({args.code.resolve().name}; gpu_memory_utilization "
        f"{GPU_MEMORY_UTILIZATION})",
        ["model", "layers", "max tokens", "runner", "pool GiB", "capture s"],
        [[r["model"], r["num_layers"], r["max_tokens"], r["runner"], r["pool_gib"],
          r["capture_s"]] for r in rows])
    print_table("ready", ["model", "layers", "max tokens", "ready s", "KV tokens"],
                [[m["model"], m["num_layers"], m["max_tokens"], m["ready_s"], m["kv_tokens"]]
                 for m in models])
    name = "bench_memory" + (f"_{args.label}" if args.label else "")
    write_results(name, {"gpu_memory_utilization": GPU_MEMORY_UTILIZATION, "rows": rows,
                         "models": models})


if __name__ == "__main__":
    main()
