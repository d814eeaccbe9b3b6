"""NemotronH (Mamba2 hybrid) on dummy nemotron-h-8b, bf16: one GPU and tensor parallel 2.

Rows, each measured as `bench/model_suite.py` describes: prefill (eager, breakable,
piecewise), decode engine step at batch 1, 8 and 64 with the weight-read floor (bytes of
weights a forward reads on a rank / HBM bandwidth), bench_offline's output tok/s. Targets
(the NemotronH issue): breakable ≤ piecewise on every prefill row and ≥ 2x eager at ≤ 256
tokens; decode at batch 1 ≤ 1.35x the floor; tp2's decode step at batch 1 ≤ 0.62x tp1's.
JSON: bench/results/bench_hybrid.json.
Run: python bench/bench_hybrid.py [--configs tp1 tp2] [--parts prefill decode offline]
[--offline-requests N]. Default: tp1 with one GPU, tp1 and tp2 with two or more; each
configuration or part can run alone (the JSON keeps the others' earlier rows).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_suite import (  # noqa: E402
    Setup,
    bench_main,
    print_decode_table,
    print_offline_table,
    print_prefill_table,
    print_target,
    ratio,
    rows_of,
    value,
)

MODEL = "nemotron-h-8b"
SETUPS = {
    "tp1": Setup({"model": MODEL}),
    "tp2": Setup({"model": MODEL, "tensor_parallel_size": 2}),
}


def report(rows: list[dict]) -> None:
    print_prefill_table(rows)
    print_decode_table(rows)
    print_offline_table(rows)
    for config in SETUPS:
        short = [(r["batch"], r["tokens"]) for r in rows_of(rows, "prefill")
                 if r["config"] == config and r["mode"] == "eager" and r["tokens"] <= 256]
        speedups = [ratio(value(rows, config, "prefill", "ms", mode="eager", batch=b, tokens=t),
                          value(rows, config, "prefill", "ms", mode="breakable", batch=b,
                                tokens=t)) for b, t in short]
        if speedups and None not in speedups:
            print_target(f"{config}: least eager / breakable at ≤ 256 tokens", min(speedups),
                         "≥ 2")
        print_target(f"{config}: decode step at batch 1 / weight-read floor",
                     value(rows, config, "decode", "x_floor", batch_size=1), "≤ 1.35")
    print_target("tp2 / tp1 decode step at batch 1",
                 ratio(value(rows, "tp2", "decode", "ms_per_step", batch_size=1),
                       value(rows, "tp1", "decode", "ms_per_step", batch_size=1)), "≤ 0.62")


if __name__ == "__main__":  # the tp2 engines spawn a worker, which imports this module
    bench_main("bench_hybrid", __doc__, SETUPS, {1: ["tp1"], 2: ["tp1", "tp2"]}, report)
