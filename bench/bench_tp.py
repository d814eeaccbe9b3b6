"""Tensor parallelism on dummy qwen3-8b, bf16: tp1 and tp2 side by side in one run (2 GPUs).

Rows, each measured as `bench/model_suite.py` describes: decode engine step at batch 1, 8
and 64 and bench_offline's output tok/s, at tp1, tp2 (the default: decode-sized all-reduces
through the custom all-reduce), tp2 with `--disable-custom-all-reduce` (`tp2-nccl`) and with
`--enable-torch-symm-mem` (`tp2-symm-mem`); prefill rows (eager, breakable, piecewise) at
tp2. Targets (the tensor-parallelism issue): tp2's decode step at batch 1 at most 0.62x
tp1's; tp2's output tok/s at least 1.5x tp1's; breakable ≤ piecewise on every prefill row.
JSON: bench/results/bench_tp.json (rows carry `config` and `tp`).
Run: python bench/bench_tp.py [--configs tp1 tp2 tp2-nccl tp2-symm-mem]
[--parts prefill decode offline]
(each part or configuration can run alone; the JSON keeps the others' earlier rows).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_suite as suite  # noqa: E402

MODEL = "qwen3-8b"
SETUPS = {
    "tp1": suite.Setup({"model": MODEL}, parts=("decode", "offline")),
    **suite.tensor_parallel_setups(MODEL),
}


def report(rows: list[dict]) -> None:
    suite.print_tables(rows)
    for config in suite.TP2_CONFIGS:
        suite.print_config_ratio(f"{config} / tp1 decode step at batch 1", rows, config, "tp1",
                                 "decode", "ms_per_step", "≤ 0.62", batch_size=1)
        suite.print_config_ratio(f"{config} / tp1 output tok/s", rows, config, "tp1",
                                 "offline", "output_tok_s", "≥ 1.5")


if __name__ == "__main__":
    suite.bench_main("bench_tp", __doc__, SETUPS, {2: list(SETUPS)}, report, repeats=3)
