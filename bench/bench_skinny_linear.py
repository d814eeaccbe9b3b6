"""Decode-sized linear layers (1 to 16 rows, bf16): cuBLAS (`F.linear`) against the skinny
kernel (`bcg/kernels/skinny_linear.py`), on the projections of qwen3-0.6b, qwen3-8b at tp1
and tp2, qwen3-30b-a3b's attention and nemotron-h-8b's MLP at tp1 and tp2 (its attention
has qwen3-8b's shapes), and the logits head of each (a rank's slice of the vocabulary).
The MLP's first projection is
timed as the engine runs it, the GEMM then the activation (SiLU-and-mul of gate/up, or
NemotronH's squared ReLU of up), against the kernel with the activation fused.

Each call is timed inside a CUDA graph of `CALLS` calls, cycling through copies of the
weight that together exceed the L2 cache (each call reads its weight from HBM, as in a
model). Rows carry `model`, `proj`, `rows`, `n`, `k`, `activation`, `cublas_us`, `skinny_us`,
`skinny_over_cublas`, `floor_us` (the weight's bytes over the measured HBM bandwidth) and
the kernel's config, and `engine_uses` (whether the engine takes the kernel for the shape:
`skinny_linear.fills_device`); `--tune` sweeps configs per shape and row count and keeps
the best.
JSON: bench/results/bench_skinny_linear.json.
Run: PYTHONPATH=. python bench/bench_skinny_linear.py [--rows 1 8 16] [--models ...]
[--projs ...] [--tune]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    hbm_bandwidth_gbs,
    print_table,
    require_cuda,
    time_per_call_ms,
    write_results,
)

from bcg.kernels.skinny_linear import (  # noqa: E402
    CONFIGS,
    SkinnyConfig,
    fills_device,
    skinny_linear,
)
from bcg.layers.activation import activate  # noqa: E402
from bcg.models.presets import PRESETS  # noqa: E402
from bcg.utils import cdiv  # noqa: E402

# (preset, tensor-parallel size, its projections timed: MoE experts are another kernel's,
# and nemotron-h-8b's attention has qwen3-8b's shapes)
MODELS = [("qwen3-0.6b", 1, "attention mlp head"), ("qwen3-8b", 1, "attention mlp head"),
          ("qwen3-8b", 2, "attention mlp head"), ("qwen3-30b-a3b", 1, "attention"),
          ("nemotron-h-8b", 1, "mlp head"), ("nemotron-h-8b", 2, "mlp head")]


def projections(preset: str, tp: int, parts: str) -> dict[str, tuple[int, int, str | None]]:
    """One rank's projections of `preset` among `parts` ("attention", "mlp", "head"): name -> (N, K,
    activation), the weight `[N, K]` (`skinny_linear`'s activations; SiLU-and-mul halves
    N). KV heads are replicated below tp. A hybrid's MLP (NemotronH) is up, squared ReLU,
    down; the others' gate/up, down."""
    c = PRESETS[preset]
    hidden, head_dim = c["hidden_size"], c["head_dim"]
    shapes = {}
    if "attention" in parts:
        q_width = c["num_attention_heads"] * head_dim // tp
        kv_width = max(1, c["num_key_value_heads"] // tp) * head_dim
        shapes.update(qkv=(q_width + 2 * kv_width, hidden, None), o=(hidden, q_width, None))
    if "mlp" in parts:
        intermediate = c["intermediate_size"] // tp
        if "hybrid_override_pattern" in c:
            shapes["up"] = (intermediate, hidden, "relu_squared")
        else:
            shapes["gate_up"] = (2 * intermediate, hidden, "silu_and_mul")
        shapes["down"] = (hidden, intermediate, None)
    if "head" in parts:
        shapes["lm_head"] = (cdiv(c["vocab_size"], tp), hidden, None)
    return shapes


SHAPES = {(preset if tp == 1 else f"{preset} tp{tp}", proj): shape
          for preset, tp, parts in MODELS
          for proj, shape in projections(preset, tp, parts).items()}
CALLS = 24
ACTIVATION_LABELS = {None: "", "silu_and_mul": " +silu", "relu_squared": " +relu2"}
L2_BYTES = 50 * 2**20  # the H100's; copies of a weight fill at least twice this
DTYPE = torch.bfloat16
# each config compiles once per shape: 12 of them keep a full sweep to a few minutes
TUNE_GRID = [SkinnyConfig(*c) for c in itertools.product([16, 32, 64], [128, 256], [4],
                                                         [3, 4])]


def graph_us(calls: list) -> float:
    """µs per call of `calls`, captured in one CUDA graph in order."""
    for call in calls[:2]:
        call()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    us = time_per_call_ms(graph.replay, iters=20) * 1e3 / len(calls)
    graph.reset()
    return us


def cycled(call, weights: list[torch.Tensor]) -> list:
    """`CALLS` calls of `call(weight)`, the weights in turn."""
    return [functools.partial(call, weights[i % len(weights)]) for i in range(CALLS)]


def cublas(x: torch.Tensor, weight: torch.Tensor, activation: str | None) -> torch.Tensor:
    """The engine's path without the kernel: the GEMM, then the activation's own launch."""
    out = F.linear(x, weight)
    return out if activation is None else activate(out, activation)


def cublas_calls(x: torch.Tensor, weights: list[torch.Tensor], activation: str | None) -> list:
    def call(weight: torch.Tensor) -> torch.Tensor:
        return cublas(x, weight, activation)

    return cycled(call, weights)


def skinny_calls(x: torch.Tensor, weights: list[torch.Tensor], activation: str | None,
                 config: SkinnyConfig) -> list:
    def call(weight: torch.Tensor) -> torch.Tensor:
        return skinny_linear(x, weight, activation=activation, config=config)

    return cycled(call, weights)


def check(x: torch.Tensor, weight: torch.Tensor, activation: str | None,
          config: SkinnyConfig) -> None:
    """The kernel's output against cuBLAS's (bf16 rounding apart)."""
    ours = skinny_linear(x, weight, activation=activation, config=config).float()
    theirs = cublas(x, weight, activation).float()
    error = ((ours - theirs).norm() / theirs.norm()).item()
    if error > 2e-2:
        raise AssertionError(f"skinny_linear is {error:.2e} from cuBLAS with {config}")


def measure(model: str, proj: str, rows: int, hbm_gbs: float, tune: bool) -> dict:
    n, k, activation = SHAPES[(model, proj)]
    weight_bytes = n * k * DTYPE.itemsize
    copies = max(1, -(-2 * L2_BYTES // weight_bytes))
    weights = [torch.randn(n, k, dtype=DTYPE, device="cuda") * k**-0.5 for _ in range(copies)]
    x = torch.randn(rows, k, dtype=DTYPE, device="cuda")
    cublas_us = graph_us(cublas_calls(x, weights, activation))
    timings = []
    for config in TUNE_GRID if tune else [CONFIGS.gpu]:
        try:
            check(x, weights[0], activation, config)
            timings.append((graph_us(skinny_calls(x, weights, activation, config)), config))
        except Exception as error:  # out of shared memory or registers: skip the config
            print(f"  {model} {proj} rows {rows} {config}: {type(error).__name__}: {error}")
    best_us, best = min(timings, key=lambda t: t[0])
    return {"model": model, "proj": proj, "rows": rows, "n": n, "k": k, "activation": activation,
            "cublas_us": cublas_us, "skinny_us": best_us, "skinny_over_cublas": best_us / cublas_us,
            "floor_us": weight_bytes / (hbm_gbs * 1e9) * 1e6, "config": asdict(best),
            "tuned": tune, "engine_uses": fills_device(weights[0], activation)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 16])
    parser.add_argument("--models", nargs="+", default=sorted({m for m, _ in SHAPES}),
                        choices=sorted({m for m, _ in SHAPES}))
    parser.add_argument("--projs", nargs="+", default=sorted({p for _, p in SHAPES}),
                        choices=sorted({p for _, p in SHAPES}))
    parser.add_argument("--tune", action="store_true",
                        help=f"sweep {len(TUNE_GRID)} configs per shape and row count")
    args = parser.parse_args()
    require_cuda("bench_skinny_linear")
    torch.manual_seed(0)
    hbm_gbs = hbm_bandwidth_gbs()
    rows = [measure(model, proj, count, hbm_gbs, args.tune)
            for (model, proj), count in itertools.product(SHAPES, args.rows)
            if model in args.models and proj in args.projs]
    write_results("bench_skinny_linear", {"hbm_gbs": hbm_gbs, "rows": rows})
    print_table(f"decode-sized linear layers, µs per call in CUDA graphs (HBM {hbm_gbs:.0f} GB/s)",
                ["model", "proj", "rows", "N x K", "cuBLAS", "skinny", "skinny/cuBLAS",
                 "floor", "config", "engine uses"],
                [[r["model"], r["proj"] + ACTIVATION_LABELS[r["activation"]], r["rows"],
                  f"{r['n']}x{r['k']}", r["cublas_us"], r["skinny_us"],
                  r["skinny_over_cublas"], r["floor_us"],
                  "/".join(map(str, r["config"].values())), r["engine_uses"]] for r in rows])


if __name__ == "__main__":
    main()
