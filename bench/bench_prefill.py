"""Prefill latency of the transformer stack: eager vs breakable graphs vs piecewise
(`torch.compile` split at attention, plus graphs) vs one full CUDA graph of the exact batch.

Dummy weights in bf16. Each row is one prefill of `batch` sequences sharing `tokens` new
tokens (no cached prefix), as the engine runs it: the stack on every token, then the LM head
on each sequence's last token (the head runs eagerly in the graph modes, as in the engine).
Graph buckets are the token counts measured, so no row pays for padding. Each time is the
median of 5 timings, the modes of a row interleaved. Floors: weight bytes / measured HBM
bandwidth, and the weight matmuls' FLOPs / measured matmul throughput. "matmuls alone" replays
one CUDA graph of just the forward's weight matmuls at this token count (cuBLAS, nothing
else): what any mode that keeps cuBLAS's GEMMs can at best reach.
Run: python bench/bench_prefill.py [--models qwen3-0.6b qwen3-8b]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    decode_weight_bytes,
    hbm_bandwidth_gbs,
    matmul_tflops,
    print_table,
    require_cuda,
    time_per_call_ms,
    write_results,
)

from bcg.config import EngineConfig  # noqa: E402
from bcg.layers.embedding import LMHead  # noqa: E402
from bcg.layers.linear import Linear  # noqa: E402
from bcg.loader.model_source import resolve_model  # noqa: E402
from bcg.runner.batch import SyntheticSequence  # noqa: E402
from bcg.runner.model_runner import ModelRunner  # noqa: E402
from bcg.runner.prefill_graph import PrefillGraphRunner  # noqa: E402
from bcg.utils import cdiv  # noqa: E402

BATCH_SIZES = (1, 4, 16)
TOKENS = (16, 64, 256, 1024, 4096)
MAX_MODEL_LEN = 4096


def make_runner(model: str) -> tuple[ModelRunner, EngineConfig]:
    config = EngineConfig(
        model=model,
        load_format="dummy",
        prefill_graph="none",
        decode_graph="none",
        max_num_seqs=max(BATCH_SIZES),
        max_num_batched_tokens=max(TOKENS),
        gpu_memory_utilization=0.75,
        prefill_graph_tokens=",".join(map(str, TOKENS)),
    )
    return ModelRunner(config, resolve_model(model, dummy_weights=True), MAX_MODEL_LEN), config


def make_batch(runner: ModelRunner, batch: int, tokens: int):
    """`batch` fresh prompts; a hybrid's each in its own state slot (max_num_seqs of them),
    so the mixer writes every final state, as the engine's prefills do."""
    per_seq = tokens // batch
    blocks = cdiv(per_seq, runner.block_size)
    seqs = [
        SyntheticSequence(
            [(7 * i + s) % 1000 for i in range(per_seq)], list(range(s * blocks, (s + 1) * blocks)),
            state_slot=s if runner.num_state_slots else -1,
        )
        for s in range(batch)
    ]
    return runner.prepare(seqs, [per_seq] * batch)


def prefill_step(forward, runner: ModelRunner, batch) -> torch.Tensor:
    """The stack through `forward`, then the head on each sequence's last token."""
    return runner.model.compute_logits(forward(batch)[batch.sample_indices])


def captured(step):
    """`step` (after one warm-up call) as the replay of one CUDA graph."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def full_graph_step(runner: ModelRunner, batch):
    """One CUDA graph of the whole prefill for this exact batch (attention included): the
    bound a graph can reach when nothing about the batch changes."""
    return captured(functools.partial(prefill_step, runner.forward_eager, runner, batch))


def weight_matmuls(model: torch.nn.Module, batch_size: int, tokens: int) -> list:
    """(rows, weight) of every weight matmul a prefill runs: the stack's projections on every
    token, the head on one row per sequence (the embedding is a gather, not a matmul)."""
    return [(batch_size if isinstance(m, LMHead) else tokens, m.weight)
            for m in model.modules() if isinstance(m, (Linear, LMHead))]


def compute_floor_ms(model: torch.nn.Module, batch_size: int, tokens: int, tflops: float) -> float:
    """The weight matmuls' FLOPs at the measured matmul peak (attention's are left out, so
    this stays a lower bound)."""
    flops = sum(2 * rows * w.numel() for rows, w in weight_matmuls(model, batch_size, tokens))
    return flops / (tflops * 1e12) * 1e3


def matmuls_alone_step(model: torch.nn.Module, batch_size: int, tokens: int):
    """One CUDA graph of every weight matmul the prefill runs on random activations:
    cuBLAS's time with no other op in between."""
    weights = weight_matmuls(model, batch_size, tokens)
    inputs = {(rows, w.shape[1]): torch.randn(rows, w.shape[1], device=w.device, dtype=w.dtype)
              for rows, w in weights}

    def matmuls() -> None:
        for rows, weight in weights:
            torch.nn.functional.linear(inputs[rows, weight.shape[1]], weight)

    return captured(matmuls)


@torch.inference_mode()
def bench_model(model: str, floors: dict) -> tuple[list[dict], list[dict]]:
    runner, config = make_runner(model)
    weight_floor_ms = decode_weight_bytes(runner.model) / (floors["hbm_gbs"] * 1e9) * 1e3
    graph_runners, startup = {"eager": []}, []
    for mode in ("breakable", "piecewise"):
        prefill = PrefillGraphRunner.from_config(
            runner.stack_spec, dataclasses.replace(config, prefill_graph=mode))
        prefill.capture_all()
        graph_runners[mode] = [prefill]
        startup.append({"model": model, "mode": mode, "capture_s": prefill.capture_seconds,
                        "pool_gib": prefill.pool_bytes / 2**30})
    rows = []
    for batch_size in BATCH_SIZES:
        for tokens in TOKENS:
            batch = make_batch(runner, batch_size, tokens)
            steps = {mode: functools.partial(prefill_step, runner.forward, runner, batch)
                     for mode in graph_runners}
            steps["full graph"] = full_graph_step(runner, batch)
            steps["matmuls alone"] = matmuls_alone_step(runner.model, batch_size, tokens)
            timings = interleaved_timings_ms(runner, graph_runners, steps, tokens)
            compute_ms = compute_floor_ms(runner.model, batch_size, tokens, floors["tflops"])
            rows += [{"model": model, "mode": name, "batch": batch_size, "tokens": tokens,
                      "ms": ms, "weight_floor_ms": weight_floor_ms,
                      "compute_floor_ms": compute_ms} for name, ms in timings.items()]
    return rows, startup


def interleaved_timings_ms(runner: ModelRunner, graph_runners: dict, steps: dict, tokens: int,
                           trials: int = 5) -> dict[str, float]:
    """Median over `trials` rounds, each timing every step once in turn: host-bound rows
    drift with the machine (clocks, other processes), and interleaving spreads that drift
    over all modes instead of charging it to whichever mode ran first."""
    iters = max(2, min(40, 4_000 // tokens))
    samples = {name: [] for name in steps}
    for _ in range(trials):
        for name, step in steps.items():
            runner.graph_runners = graph_runners.get(name, [])
            samples[name].append(time_per_call_ms(step, iters))
    return {name: statistics.median(times) for name, times in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b", "qwen3-8b"])
    args = parser.parse_args()
    require_cuda("bench_prefill")
    floors = {"hbm_gbs": hbm_bandwidth_gbs(), "tflops": matmul_tflops()}
    rows, startup = [], []
    for model in args.models:
        model_rows, model_startup = bench_model(model, floors)
        rows += model_rows
        startup += model_startup
        # Free this model's runner (its KV cache takes most of the GPU) before the next:
        # only once bench_model has returned are its locals gone; compiled code holds it too.
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
    table = {}
    for r in rows:
        key = (r["model"], r["batch"], r["tokens"])
        table.setdefault(key, dict(weight=r["weight_floor_ms"], compute=r["compute_floor_ms"]))
        table[key][r["mode"]] = r["ms"]
    modes = ["eager", "breakable", "piecewise", "full graph", "matmuls alone"]
    print_table(
        f"prefill ms (stack + head; HBM {floors['hbm_gbs']:.0f} GB/s, "
        f"matmul {floors['tflops']:.0f} TFLOP/s)",
        ["model", "batch", "tokens", *modes, "eager/breakable", "floor (max)"],
        [
            [
                *key,
                *[v.get(m, "-") for m in modes],
                v["eager"] / v["breakable"],
                max(v["weight"], v["compute"]),
            ]
            for key, v in table.items()
        ],
    )
    print_table(
        "start-up",
        ["model", "mode", "capture s", "graph pool GiB"],
        [[s["model"], s["mode"], s["capture_s"], s["pool_gib"]] for s in startup],
    )
    write_results("bench_prefill_" + "_".join(args.models),
                  {"floors": floors, "rows": rows, "startup": startup})


if __name__ == "__main__":
    main()
