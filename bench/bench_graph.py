"""Breakable CUDA graph core: replay and capture cost against eager, one full CUDA graph,
and the `breakable-cuda-graphs` package, on a synthetic layer stack.

Each layer runs a few small kernels and one with-output break doing one small kernel.
Run: python bench/bench_graph.py [--layers 32]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, require_cuda, time_per_call_ms, write_results  # noqa: E402

from bcg.graph import BreakableCUDAGraph, BreakableCUDAGraphCapture, eager_on_graph  # noqa: E402

WORKLOADS = {  # name: (tokens, width); "light" is host-bound, "heavy" GPU-bound per segment
    "light": (8, 256),
    "heavy": (4096, 2048),
}


def break_body(hidden: torch.Tensor, out: torch.Tensor) -> None:
    torch.add(hidden, 1.0, out=out)


def make_stack(weights: list[torch.Tensor], brk: Callable) -> Callable:
    def run(x: torch.Tensor) -> torch.Tensor:
        for weight in weights:
            hidden = torch.nn.functional.silu(x @ weight) * 0.5 + x
            out = torch.empty_like(hidden)
            brk(hidden, out)
            x = out * 0.9
        return x

    return run


def peer_module():
    try:
        import breakable_cuda_graphs
    except ImportError:
        return None
    return breakable_cuda_graphs


def capture_full(run: Callable, x: torch.Tensor, pool=None) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        run(x)
    return graph


def capture_ours(run: Callable, x: torch.Tensor, pool=None) -> BreakableCUDAGraph:
    graph = BreakableCUDAGraph()
    with BreakableCUDAGraphCapture(graph, pool=pool):
        run(x)
    return graph


def capture_peer(peer, run: Callable, x: torch.Tensor, pool=None):
    graph = peer.BreakableCUDAGraph(pool=pool)
    with peer.breakable_graph(graph):
        run(x)
    return graph


def mode_runners(weights: list[torch.Tensor]) -> dict[str, tuple[Callable, Callable]]:
    """name -> (stack function, capture function or None for eager)."""
    modes = {
        "eager": (make_stack(weights, break_body), None),
        "full graph": (make_stack(weights, break_body), capture_full),
        "bcg breakable": (make_stack(weights, eager_on_graph(break_body)), capture_ours),
    }
    peer = peer_module()
    if peer is not None:
        modes["breakable-cuda-graphs"] = (
            make_stack(weights, peer.no_graph(break_body)),
            lambda run, x, pool=None: capture_peer(peer, run, x, pool),
        )
    return modes


def timed_capture_ms(capture: Callable, run: Callable, inputs: list[torch.Tensor]) -> float:
    for x in inputs:  # warm-up, as a runner does before capturing
        run(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    pool = None
    for x in inputs:
        graph = capture(run, x, pool)
        pool = graph.pool()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def replay_step(run: Callable, capture: Callable | None, x: torch.Tensor) -> Callable:
    if capture is None:
        return functools.partial(run, x)
    run(x)
    torch.cuda.synchronize()
    return capture(run, x).replay


def break_body_us(tokens: int, width: int, iters: int) -> float:
    hidden = torch.randn(tokens, width, device="cuda")
    out = torch.empty_like(hidden)
    return time_per_call_ms(functools.partial(break_body, hidden, out), iters) * 1e3


def bench_workload(workload: str, layers: int, iters: int) -> list[dict]:
    tokens, width = WORKLOADS[workload]
    weights = [torch.randn(width, width, device="cuda") * 0.02 for _ in range(layers)]
    x = torch.randn(tokens, width, device="cuda")
    times = {
        mode: time_per_call_ms(replay_step(run, capture, x), iters)
        for mode, (run, capture) in mode_runners(weights).items()
    }
    body_us = break_body_us(tokens, width, iters * layers)
    full = times["full graph"]
    rows = []
    for mode, ms in times.items():
        row = {"workload": workload, "mode": mode, "replay_ms": ms, "break_body_us": body_us}
        if mode not in ("eager", "full graph"):
            row["us_per_break"] = (ms - full) * 1e3 / layers
            row["us_per_break_beyond_body"] = row["us_per_break"] - body_us
            row["x_full_graph"] = ms / full
        rows.append(row)
    return rows


def bench_replay(layers: int, iters: int) -> list[dict]:
    return [row for workload in WORKLOADS for row in bench_workload(workload, layers, iters)]


def bench_capture(layers: int) -> list[dict]:
    tokens, width = WORKLOADS["light"]
    weights = [torch.randn(width, width, device="cuda") * 0.02 for _ in range(layers)]
    one = [torch.randn(tokens, width, device="cuda")]
    many = [torch.randn(8 * (i + 1), width, device="cuda") for i in range(32)][::-1]
    rows = []
    for mode, (run, capture) in mode_runners(weights).items():
        if capture is None:
            continue
        rows.append(
            {
                "mode": mode,
                "capture_ms_1_size": timed_capture_ms(capture, run, one),
                "capture_ms_32_sizes": timed_capture_ms(capture, run, many),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32, help="layers = breaks per replay")
    parser.add_argument("--iters", type=int, default=200, help="timed replays per mode")
    args = parser.parse_args()
    require_cuda("bench_graph")
    torch.manual_seed(0)
    replay = bench_replay(args.layers, args.iters)
    capture = bench_capture(args.layers)
    print_table(
        f"replay, {args.layers} layers/breaks (light: {WORKLOADS['light']}, heavy: "
        f"{WORKLOADS['heavy']} tokens x width)",
        ["workload", "mode", "ms/step", "x full", "us/break", "beyond body", "body us"],
        [
            [
                r["workload"],
                r["mode"],
                r["replay_ms"],
                r.get("x_full_graph", "-"),
                r.get("us_per_break", "-"),
                r.get("us_per_break_beyond_body", "-"),
                r["break_body_us"],
            ]
            for r in replay
        ],
    )
    print_table(
        f"capture, {args.layers} breaks per graph",
        ["mode", "ms (1 size)", "ms (32 sizes)"],
        [[r["mode"], r["capture_ms_1_size"], r["capture_ms_32_sizes"]] for r in capture],
    )
    write_results(
        "bench_graph",
        {"layers": args.layers, "workloads": WORKLOADS, "replay": replay, "capture": capture},
    )


if __name__ == "__main__":
    main()
