"""The fused MoE kernel alone on Qwen3-MoE expert shapes (bf16, H100), and a tile tuner.

Shapes: Qwen3-30B-A3B's experts (128 experts, top-8, hidden 2048, moe_intermediate 768),
and optionally Qwen3-235B-A22B's (hidden 4096, moe_intermediate 1536) as one rank of tp8
(intermediate 192) or ep8 (16 experts).
- decode-sized steps: weight bytes of the experts a step touches, read per second, against
  the HBM bandwidth this script measures (one large device copy, bytes read + written).
- prefill-sized steps: TFLOP/s against a large dense bf16 matmul.
Each step is timed inside a CUDA graph (as the runners use it); ROUTINGS graphs with
different random routings replay in turn, so the experts they touch change call to call.

Run: PYTHONPATH=. python bench/bench_moe_kernel.py [--shapes 30b 235b-tp8 235b-ep8] [--tune]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import astuple, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    hbm_bandwidth_gbs,
    matmul_tflops,
    print_table,
    require_cuda,
    time_per_call_ms,
    write_results,
)

from bcg.kernels.fused_moe import DECODE_TILES, MoETiles, fused_experts, moe_tiles  # noqa: E402
from bcg.layers.fused_moe import select_experts  # noqa: E402

# name -> (experts, top-k, hidden, intermediate held by one rank)
SHAPES = {
    "30b": (128, 8, 2048, 768),
    "235b-tp8": (128, 8, 4096, 1536 // 8),
    "235b-ep8": (128 // 8, 8, 4096, 1536),  # top-8 of 128 globally; here ids of 16 local
}
TOKENS = [1, 8, 64, 512, 2048, 4096]
ROUTINGS = 8
DTYPE = torch.bfloat16
# block_m, block_n, block_k, group_m, warps, stages (and for decode, SiLU-and-mul fused into
# the first GEMM); each config compiles once. Decode-sized steps stream weights (narrow
# column tiles spread them over more programs, long K tiles keep loads in flight);
# prefill-sized ones are compute-bound GEMMs.
DECODE_TUNE_GRID = list(itertools.product([16], [32, 64, 128], [128, 256], [1], [4, 8],
                                          [3, 4, 5], [False, True]))
PREFILL_TUNE_GRID = list(itertools.product([64, 128], [64, 128], [64], [8], [4, 8], [3, 4]))


@dataclass
class Step:
    hidden_states: torch.Tensor
    routings: list[tuple[torch.Tensor, torch.Tensor]]  # (weights, ids) per graph
    num_experts_global: int

    def touched_experts(self) -> float:
        """Mean count of distinct local experts a routing touches."""
        return sum(int(ids[ids >= 0].unique().numel()) for _, ids in self.routings) / len(
            self.routings)


def make_step(num_tokens: int, num_experts: int, top_k: int, hidden: int,
              expert_parallel: bool) -> Step:
    """Random tokens and routings; under expert parallel the routing is over 8x the local
    experts and this rank's share keeps ids 0..num_experts-1, the rest -1."""
    global_experts = num_experts * 8 if expert_parallel else num_experts
    routings = []
    for _ in range(ROUTINGS):
        logits = torch.randn(num_tokens, global_experts, device="cuda")
        weights, ids = select_experts(logits, top_k, renormalize=True)
        routings.append((weights, ids.masked_fill(ids >= num_experts, -1)))
    hidden_states = torch.randn(num_tokens, hidden, dtype=DTYPE, device="cuda")
    return Step(hidden_states, routings, global_experts)


def graph_ms(step: Step, gate_up: torch.Tensor, down: torch.Tensor,
             tiles: MoETiles | None) -> float:
    """Device time per call, each routing captured in its own CUDA graph."""
    graphs = []
    for weights, ids in step.routings:
        def call(weights=weights, ids=ids) -> torch.Tensor:
            return fused_experts(step.hidden_states, gate_up, down, weights, ids, tiles)

        call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        graphs.append(graph)

    def replay_all() -> None:
        for graph in graphs:
            graph.replay()

    return time_per_call_ms(replay_all, iters=20) / len(graphs)


def measure(shape: str, token_counts: list[int],
            tiles_for: dict[int, MoETiles] | None = None) -> list[dict]:
    """A row per token count: time, weight bandwidth and TFLOP/s (default tiles unless
    `tiles_for` names some)."""
    num_experts, top_k, hidden, intermediate = SHAPES[shape]
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden, dtype=DTYPE,
                          device="cuda") * hidden**-0.5
    down = torch.randn(num_experts, hidden, intermediate, dtype=DTYPE,
                       device="cuda") * intermediate**-0.5
    expert_bytes = (gate_up[0].numel() + down[0].numel()) * DTYPE.itemsize
    rows = []
    for num_tokens in token_counts:
        step = make_step(num_tokens, num_experts, top_k, hidden, shape.endswith("ep8"))
        tiles = (tiles_for or {}).get(num_tokens)
        ms = graph_ms(step, gate_up, down, tiles)
        local_choices = sum(int((ids >= 0).sum()) for _, ids in step.routings) / ROUTINGS
        weight_bytes = step.touched_experts() * expert_bytes
        flops = 6 * local_choices * intermediate * hidden
        used = tiles or moe_tiles(num_tokens * top_k, num_experts, on_cuda=True)
        rows.append({"shape": shape, "tokens": num_tokens, "ms": ms,
                     "weight_gbs": weight_bytes / (ms * 1e-3) / 1e9,
                     "tflops": flops / (ms * 1e-3) / 1e12, "tiles": astuple(used)})
    return rows


def tune(shape: str) -> dict[int, MoETiles]:
    """The fastest tile config per token count (prints the top 5 of each)."""
    best = {}
    num_experts, top_k = SHAPES[shape][:2]
    for num_tokens in TOKENS:
        decode_sized = (moe_tiles(num_tokens * top_k, num_experts, on_cuda=True)
                        == DECODE_TILES.for_device(True))
        timings = []
        for candidate in DECODE_TUNE_GRID if decode_sized else PREFILL_TUNE_GRID:
            tiles = MoETiles(*candidate)
            try:
                [row] = measure(shape, [num_tokens], {num_tokens: tiles})
            except Exception as error:  # out of shared memory or registers: skip the config
                print(f"  {candidate}: {type(error).__name__}")
                continue
            timings.append((row["ms"], candidate))
        timings.sort()
        best[num_tokens] = MoETiles(*timings[0][1])
        print_table(f"tune {shape}, {num_tokens} tokens (block_m/n/k, group_m, warps, stages"
                    f"{', fused' if decode_sized else ''})",
                    ["config", "ms"], [[str(c), ms] for ms, c in timings[:5]])
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["30b"], choices=sorted(SHAPES))
    parser.add_argument("--tune", action="store_true",
                        help="sweep tile configs per token count and measure the best")
    args = parser.parse_args()
    require_cuda("bench_moe_kernel")
    torch.manual_seed(0)
    hbm_gbps, peak_tflops = hbm_bandwidth_gbs(), matmul_tflops()
    print(f"device {torch.cuda.get_device_name()}: HBM copy {hbm_gbps:.0f} GB/s (read + "
          f"write), dense bf16 matmul {peak_tflops:.0f} TFLOP/s")
    results = {"hbm_gbps": hbm_gbps, "matmul_tflops": peak_tflops, "rows": []}
    for shape in args.shapes:
        rows = measure(shape, TOKENS)
        if args.tune:
            rows += [dict(r, tuned=True) for r in measure(shape, TOKENS, tune(shape))]
        results["rows"] += rows
        print_table(f"fused MoE, {shape} (timed in CUDA graphs)",
                    ["tokens", "tuned", "ms", "weight GB/s", "HBM frac", "TFLOP/s",
                     "matmul frac", "tiles"],
                    [[r["tokens"], r.get("tuned", False), r["ms"], r["weight_gbs"],
                      r["weight_gbs"] / hbm_gbps, r["tflops"], r["tflops"] / peak_tflops,
                      "/".join(map(str, r["tiles"]))] for r in rows])
    write_results("bench_moe_kernel", results)


if __name__ == "__main__":
    main()
