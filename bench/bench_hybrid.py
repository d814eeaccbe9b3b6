"""NemotronH (Mamba2 hybrid) on dummy nemotron-h-8b, bf16: one GPU and tensor parallel 2.

Rows, each measured as `bench/model_suite.py` describes: prefill (eager, breakable,
piecewise), decode engine step at batch 1, 8 and 64 with the weight-read floor (bytes of
weights a forward reads on a rank / HBM bandwidth), bench_offline's output tok/s. Targets
(the NemotronH issue): breakable ≤ piecewise on every prefill row and ≥ 2x eager at ≤ 256
tokens; decode at batch 1 ≤ 1.35x the floor; tp2's decode step at batch 1 ≤ 0.62x tp1's.
JSON: bench/results/bench_hybrid.json.
Run: python bench/bench_hybrid.py [--configs tp1 tp2 tp2-symm-mem] [--parts prefill decode
offline] [--offline-requests N]. Default: tp1 with one GPU, tp1 and tp2 (decode-sized
all-reduces through the custom all-reduce) with two or more; `tp2-nccl`
(`--disable-custom-all-reduce`) and `tp2-symm-mem` (`--enable-torch-symm-mem`), decode and
offline, on request. Each
configuration or part can run alone (the JSON keeps the others' earlier rows).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_suite as suite  # noqa: E402

MODEL = "nemotron-h-8b"
SETUPS = {
    "tp1": suite.Setup({"model": MODEL}),
    **suite.tensor_parallel_setups(MODEL),  # tp2-nccl and tp2-symm-mem on request
}


def report(rows: list[dict]) -> None:
    suite.print_tables(rows)
    for config, setup in SETUPS.items():
        if "prefill" in setup.parts:
            suite.print_target(f"{config}: least eager / breakable at ≤ 256 tokens",
                               least_speedup(rows, config, max_tokens=256), "≥ 2")
        suite.print_target(f"{config}: decode step at batch 1 / weight-read floor",
                           suite.value(rows, config, "decode", "x_floor", batch_size=1), "≤ 1.35")
    for config in suite.TP2_CONFIGS:
        suite.print_config_ratio(f"{config} / tp1 decode step at batch 1", rows, config, "tp1",
                                 "decode", "ms_per_step", "≤ 0.62", batch_size=1)


def least_speedup(rows: list[dict], config: str, max_tokens: int) -> float | None:
    """The smallest eager / breakable over `config`'s prefill rows of ≤ `max_tokens` tokens
    (None unless both modes were measured on at least one such row)."""
    speedups = [suite.ratio(eager["ms"], suite.value(rows, config, "prefill", "ms",
                                                     mode="breakable", batch=eager["batch"],
                                                     tokens=eager["tokens"]))
                for eager in suite.rows_of(rows, "prefill")
                if eager["config"] == config and eager["mode"] == "eager"
                and eager["tokens"] <= max_tokens]
    return min(speedups) if speedups and None not in speedups else None


if __name__ == "__main__":
    suite.bench_main("bench_hybrid", __doc__, SETUPS, {1: ["tp1"], 2: ["tp1", "tp2"]}, report)
