"""Breakable CUDA graph core: replay and capture cost against eager, one full CUDA graph,
and the `breakable-cuda-graphs` package, on a synthetic layer stack.

Each layer runs a few small kernels and one with-output break doing one small kernel.
"segment launch us" is the host time to launch one one-kernel CUDA graph from a Python loop
with torch's `replay()`: the floor under a breakable replay's cost per break when it launches
its segments as torch does (bcg launches them through the CUDA driver, below that floor).
Each breakable mode's replay is also taken apart: the host time of its segment launches
alone and of its break calls alone, per segment and per break (`segment_host_us`,
`break_host_us`), each run in replay order without the other, so the libraries' costs
beyond the body can be told apart.
Run: python bench/bench_graph.py [--layers 32]
"""

from __future__ import annotations

import argparse
import functools
import gc
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
ITERS = {"light": 200, "heavy": 20}  # timed calls per measurement


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


def host_issue_us(fn: Callable[[], object], iters: int) -> float:
    """Host time to issue one call, measured from an idle GPU queue each time."""
    total = 0.0
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        total += time.perf_counter() - start
    torch.cuda.synchronize()
    return total * 1e6 / iters


def best_of(measure: Callable[[Callable], float], steps: dict[str, Callable], repeats: int):
    """The best of `repeats` measurements per mode, modes interleaved so that drifts in
    clocks or background load hit every mode alike."""
    results: dict[str, list[float]] = {mode: [] for mode in steps}
    for _ in range(repeats):
        for mode, step in steps.items():
            results[mode].append(measure(step))
    return {mode: min(values) for mode, values in results.items()}


def replay_parts(replay: Callable[[], None]) -> tuple[list[Callable], list[Callable]]:
    """The segment launches and the break calls of a breakable graph's `replay`, each in
    replay order, as each library's replay calls them (reads private fields)."""
    graph = replay.__self__
    if isinstance(graph, BreakableCUDAGraph):
        replay()  # the first replay chooses each segment's launch
        steps = list(zip(graph._replay_steps(), graph._labels, strict=True))
        return ([step for step, label in steps if label.startswith("segment")],
                [step for step, label in steps if label.startswith("break")])
    segments = [s for s in graph._segments if isinstance(s, torch.cuda.CUDAGraph)]
    return ([s.replay for s in segments],
            [s.replay for s in graph._segments if not isinstance(s, torch.cuda.CUDAGraph)])


def calls(functions: list[Callable]) -> Callable[[], None]:
    def run() -> None:
        for function in functions:
            function()

    return run


def segment_launches(layers: int, x: torch.Tensor) -> Callable[[], None]:
    """`layers` CUDA graphs of one small kernel each, replayed back to back from a Python
    loop (the way torch replays a segment): what launching the segments alone costs the host,
    the floor under the cost per break of a replay that launches segments as torch does."""
    replays = []
    for _ in range(layers):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            x.mul_(1.0)
        replays.append(super(torch.cuda.CUDAGraph, graph).replay)
    return calls(replays)


def bench_workload(workload: str, layers: int, repeats: int) -> list[dict]:
    tokens, width = WORKLOADS[workload]
    iters = ITERS[workload]
    weights = [torch.randn(width, width, device="cuda") * 0.02 for _ in range(layers)]
    x = torch.randn(tokens, width, device="cuda")
    steps = {mode: replay_step(run, cap, x) for mode, (run, cap) in mode_runners(weights).items()}
    hidden = torch.randn(tokens, width, device="cuda")
    steps["break body"] = functools.partial(break_body, hidden, torch.empty_like(hidden))
    steps["segment launches"] = segment_launches(layers, torch.randn(tokens, width, device="cuda"))
    parts = {}  # "<mode> segments" / "<mode> breaks" -> number of calls
    for mode in [m for m in steps if m not in ("eager", "full graph", "break body",
                                                "segment launches")]:
        segments, breaks = replay_parts(steps[mode])
        steps[f"{mode} segments"], parts[f"{mode} segments"] = calls(segments), len(segments)
        steps[f"{mode} breaks"], parts[f"{mode} breaks"] = calls(breaks), len(breaks)
    wall_ms = best_of(lambda step: time_per_call_ms(step, iters), steps, repeats)
    host_us = best_of(lambda step: host_issue_us(step, iters), steps, repeats)
    body_us = host_us.pop("break body")
    launch_us = host_us.pop("segment launches") / layers
    for part, count in parts.items():
        host_us[part] /= count
    for part in ["break body", "segment launches", *parts]:
        wall_ms.pop(part)
    rows = []
    for mode, ms in wall_ms.items():
        row = {
            "workload": workload,
            "mode": mode,
            "replay_ms": ms,
            "host_issue_us": host_us[mode],
            "break_body_host_us": body_us,
            "segment_launch_host_us": launch_us,
        }
        if mode not in ("eager", "full graph"):
            row["x_full_graph"] = ms / wall_ms["full graph"]
            added = (host_us[mode] - host_us["full graph"]) / layers
            row["host_us_per_break_beyond_body"] = added - body_us
            row["segment_host_us"] = host_us[f"{mode} segments"]
            row["break_host_us"] = host_us[f"{mode} breaks"]
        rows.append(row)
    return rows


def bench_replay(layers: int, repeats: int) -> list[dict]:
    return [row for workload in WORKLOADS for row in bench_workload(workload, layers, repeats)]


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


def python_heap_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


def bench_capture_heaps(layers: int) -> list[dict]:
    """Capture cost in a bare process and with an engine-like Python heap: a capture
    that collects garbage per segment pays for every live object each time."""
    rows = [dict(row, heap_objects=python_heap_objects()) for row in bench_capture(layers)]
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM  # noqa: F401  (engine-like heap)

    return rows + [dict(row, heap_objects=python_heap_objects()) for row in bench_capture(layers)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32, help="layers = breaks per replay")
    parser.add_argument("--repeats", type=int, default=5, help="measurements per mode (best kept)")
    args = parser.parse_args()
    require_cuda("bench_graph")
    torch.manual_seed(0)
    replay = bench_replay(args.layers, args.repeats)
    capture = bench_capture_heaps(args.layers)
    print_table(
        f"replay, {args.layers} layers/breaks (light: {WORKLOADS['light']}, heavy: "
        f"{WORKLOADS['heavy']} tokens x width)",
        [
            "workload",
            "mode",
            "ms/step",
            "x full graph",
            "host us/step",
            "host us/break beyond body",
            "body host us",
            "segment launch us",
            "its segment us",
            "its break us",
        ],
        [
            [
                r["workload"],
                r["mode"],
                r["replay_ms"],
                r.get("x_full_graph", "-"),
                r["host_issue_us"],
                r.get("host_us_per_break_beyond_body", "-"),
                r["break_body_host_us"],
                r["segment_launch_host_us"],
                r.get("segment_host_us", "-"),
                r.get("break_host_us", "-"),
            ]
            for r in replay
        ],
    )
    print_table(
        f"capture, {args.layers} breaks per graph",
        ["python heap objects", "mode", "ms (1 size)", "ms (32 sizes)"],
        [
            [r["heap_objects"], r["mode"], r["capture_ms_1_size"], r["capture_ms_32_sizes"]]
            for r in capture
        ],
    )
    write_results(
        "bench_graph",
        {"layers": args.layers, "workloads": WORKLOADS, "replay": replay, "capture": capture},
    )


if __name__ == "__main__":
    main()
