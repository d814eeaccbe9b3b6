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
from common import merged_rows, print_table, require_cuda, write_results  # noqa: E402

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
import cProfile, json, logging, pstats, sys, time
import torch
from bcg.engine.llm import LLM
from bcg.models.presets import PRESETS
model, layers, max_tokens, util = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
profile_top = int(sys.argv[5])
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
profiler = cProfile.Profile() if profile_top else None
start = time.perf_counter()
if profiler:
    profiler.enable()
llm = LLM(model, load_format="dummy", max_num_batched_tokens=max_tokens,
          gpu_memory_utilization=util)
ready_s = time.perf_counter() - start
profile = []  # the start-up's functions by own time: where the seconds go
if profiler:
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    for (file, line, name), (_, calls, own, total, _) in sorted(
            stats.items(), key=lambda item: -item[1][2])[:profile_top]:
        profile.append({"function": f"{file}:{line}({name})", "calls": calls,
                        "own_s": own, "total_s": total})
runner = llm.engine.runner
print("RESULT " + json.dumps({
    "ready_s": ready_s,
    "num_layers": runner.model_config.num_hidden_layers,
    "kv_tokens": runner.num_kv_blocks * runner.block_size,
    # warm-up fields: None for a checkout before warm-ups on demand
    "runners": [{"runner": r.kind, "pool_gib": r.pool_bytes / 2**30,
                 "capture_s": r.capture_seconds,
                 "warm_up_s": getattr(r, "warm_up_seconds", None),
                 "warmed_buckets": len(getattr(r, "warmed_sizes", r.buckets)),
                 "buckets": len(r.buckets)} for r in runner.graph_runners],
    "startup_log": startup_log,
    "profile": profile,
}))
"""


def config_name(model: str, layers: int | None, max_tokens: int) -> str:
    """`model@max_tokens`, with `xlayers` for a depth other than the preset's."""
    return f"{model}@{max_tokens}" + (f"x{layers}" if layers else "")


def run_config(code: Path, model: str, layers: int | None, max_tokens: int,
               profile_top: int = 0) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{code}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    args = [sys.executable, "-c", WORKER, model, str(layers), str(max_tokens),
            str(GPU_MEMORY_UTILIZATION), str(profile_top)]
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
    parser.add_argument("--configs", nargs="+", choices=[config_name(*c) for c in CONFIGS],
                        help="only these configurations (default: all)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile the last run's start-up (cProfile) and print its N "
                        "functions of most own time (also in the JSON's models)")
    args = parser.parse_args()
    require_cuda("bench_memory")
    rows, models = [], []
    configs = [c for c in CONFIGS if args.configs is None or config_name(*c) in args.configs]
    for model, layers, max_tokens in configs:
        for run in range(args.runs):
            last = run == args.runs - 1
            result = run_config(args.code.resolve(), model, layers, max_tokens,
                                args.profile if last else 0)
        models.append({"model": model, "num_layers": result["num_layers"],
                       "max_tokens": max_tokens, "ready_s": result["ready_s"],
                       "kv_tokens": result["kv_tokens"], "startup_log": result["startup_log"],
                       **({"profile": result["profile"]} if args.profile else {})})
        print("\n".join(result["startup_log"]), flush=True)
        for entry in result["profile"]:
            print(f"  {entry['own_s']:7.3f} s own {entry['total_s']:7.3f} s total "
                  f"{entry['calls']:7d} calls  {entry['function'][-100:]}", flush=True)
        rows += [{"model": model, "num_layers": result["num_layers"], "max_tokens": max_tokens,
                  **r} for r in result["runners"]]
        summary = {k: v for k, v in result.items() if k not in ("startup_log", "profile")}
        print(f"{model} x{result['num_layers']} @{max_tokens}: {summary}", flush=True)
    print_table(
        f"graph pools and start-up ({args.code.resolve().name}; gpu_memory_utilization "
        f"{GPU_MEMORY_UTILIZATION})",
        ["model", "layers", "max tokens", "runner", "pool GiB", "capture s", "warm-up s",
         "warmed buckets"],
        [[r["model"], r["num_layers"], r["max_tokens"], r["runner"], r["pool_gib"],
          r["capture_s"], r.get("warm_up_s"), f"{r.get('warmed_buckets')} of {r.get('buckets')}"]
         for r in rows])
    print_table("ready", ["model", "layers", "max tokens", "ready s", "KV tokens"],
                [[m["model"], m["num_layers"], m["max_tokens"], m["ready_s"], m["kv_tokens"]]
                 for m in models])
    name = "bench_memory" + (f"_{args.label}" if args.label else "")
    # A subset of the configurations keeps the earlier run's rows of the others.
    write_results(name, {"gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
                         "rows": merged_rows(name, rows, key=memory_key),
                         "models": merged_rows(name, models, key=memory_key, field="models")})


def memory_key(row: dict) -> tuple:
    return row["model"], row["num_layers"], row["max_tokens"], row.get("runner")


if __name__ == "__main__":
    main()
