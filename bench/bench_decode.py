"""Decode step time of the engine, eager vs one full CUDA graph per batch size (plain steps,
and overlapped ones: `--overlap`), for the built-in SmolLM2-135M (GGUF weights) and
Qwen3-0.6B / Qwen3-8B with dummy weights, bf16.

Each case starts `batch` requests with 128-token prompts, runs the prefill, then times
`DECODE_ROUNDS` rounds of `DECODE_STEPS` engine steps in which every request decodes one
token: tok/s counts the tokens of all requests, ms/step is the wall time of one
`LLMEngine.step()` (scheduling, batch building, the eager forward, sampling and
detokenization included) in the median round.

Time per output token (tpot) is measured through `LLM.generate`, which has no per-token
timestamps, as the difference of two calls on fresh 128-token prompts (no prefix-cache hit):
tpot = (T(n) - T(1)) / (n - 1), where T(k) is the wall time of a `generate` of `batch`
requests each producing k tokens (greedy, `ignore_eos`, n = `TPOT_TOKENS`). T(1) is the time
to first token of that call (prefill, first sample, the call's own overhead), so this is
(wall time - time to first token) / (tokens - 1); each is the median of `TPOT_REPEATS` pairs.
Batch 1 is exact; a larger batch whose prefill takes several chunked steps starts its
requests' decodes a few steps apart, which T(n) - T(1) counts as decode time.

The weight-read roofline of a step is the bytes of weights one forward reads divided by the
measured HBM bandwidth. Run: python bench/bench_decode.py [--models ...] [--modes ...];
`PYTHONPATH=<checkout> python bench/bench_decode.py --modes "full graph" --label before`
measures another checkout (one from before overlapped steps runs plain steps).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    decode_weight_bytes,
    has_overlapped_steps,
    hbm_bandwidth_gbs,
    merged_rows,
    print_table,
    require_cuda,
    synchronize,
    write_results,
)

from bcg.engine.llm import LLM  # noqa: E402
from bcg.engine.llm_engine import LLMEngine  # noqa: E402
from bcg.engine.sampling_params import SamplingParams  # noqa: E402

MODELS = {  # name -> LLM arguments
    "smollm2-135m": {},
    "qwen3-0.6b": {"model": "qwen3-0.6b", "load_format": "dummy"},
    "qwen3-8b": {"model": "qwen3-8b", "load_format": "dummy"},
}
MODES = {  # plain steps, then the default (full graphs, overlapped steps) beside them
    "eager": {"decode_graph": "none", "prefill_graph": "none", "overlap": False},
    "full graph": {"decode_graph": "full", "prefill_graph": "none", "overlap": False},
    "full graph, overlapped": {"decode_graph": "full", "prefill_graph": "none", "overlap": True},
}
BATCH_SIZES = [1, 8, 64]
PROMPT_LEN = 128
WARMUP_STEPS = 4
DECODE_STEPS = 32
DECODE_ROUNDS = 3
TPOT_TOKENS = 256
TPOT_REPEATS = 3


def prompts(batch: int, seed: str) -> list[list[int]]:
    """`batch` prompts of `PROMPT_LEN` random tokens; another seed shares no prefix with them."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 5100) for _ in range(PROMPT_LEN)] for _ in range(batch)]


def measure(engine: LLMEngine, batch: int) -> float:
    """Seconds per decode step with `batch` requests decoding: the median of `round_seconds`'
    rounds, so that one round slowed by a stall of the host does not move it."""
    return statistics.median(round_seconds(engine, batch))


def round_seconds(engine: LLMEngine, batch: int) -> list[float]:
    """Seconds per decode step with `batch` requests decoding, in each of `DECODE_ROUNDS`
    rounds of `DECODE_STEPS` steps (after `WARMUP_STEPS`). No request finishes before the
    last round ends: the first to start decoding does so up to `batch` steps before the last
    (chunked prefill), and its max_tokens covers those steps too."""
    timed_steps = DECODE_ROUNDS * DECODE_STEPS
    params = SamplingParams(temperature=0, max_tokens=WARMUP_STEPS + timed_steps + batch + 2,
                            ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in prompts(batch, "steps")]
    started: set[str] = set()
    while len(started) < batch:  # prefill (possibly chunked) until every request decodes
        started.update(o.request_id for o in engine.step())
    for _ in range(WARMUP_STEPS):
        engine.step()
    rounds = [timed_round(engine) for _ in range(DECODE_ROUNDS)]
    for request_id in ids:
        engine.abort_request(request_id)
    return rounds


def timed_round(engine: LLMEngine) -> float:
    """Seconds per step of `DECODE_STEPS` engine steps, from an idle GPU to an idle GPU."""
    synchronize()
    start = time.perf_counter()
    for _ in range(DECODE_STEPS):
        engine.step()
    synchronize()
    return (time.perf_counter() - start) / DECODE_STEPS


def generate_seconds(llm: LLM, batch: int, max_tokens: int, seed: str) -> float:
    """Wall time of one `LLM.generate` of `batch` fresh prompts each producing `max_tokens`."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    batch_prompts = prompts(batch, seed)
    synchronize()
    start = time.perf_counter()
    llm.generate(batch_prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def tpot(llm: LLM, batch: int) -> tuple[float, float]:
    """Seconds per output token and to the first token through `LLM.generate` (see the module
    docstring), medians of `TPOT_REPEATS` runs."""
    firsts, tpots = [], []
    for repeat in range(TPOT_REPEATS):
        first = generate_seconds(llm, batch, 1, f"first {batch} {repeat}")
        whole = generate_seconds(llm, batch, TPOT_TOKENS, f"whole {batch} {repeat}")
        firsts.append(first)
        tpots.append((whole - first) / (TPOT_TOKENS - 1))
    return statistics.median(tpots), statistics.median(firsts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--label", default="", help="suffix of the JSON name (e.g. 'before')")
    args = parser.parse_args()
    require_cuda("bench_decode")
    hbm_gbs = hbm_bandwidth_gbs()
    rows, results = [], []
    for name in args.models:
        for mode in args.modes:
            llm = LLM(max_model_len=1024, gpu_memory_utilization=0.6,
                      decode_graph_bs=",".join(map(str, BATCH_SIZES)), **MODELS[name],
                      **engine_args(mode))
            roofline_ms = decode_weight_bytes(llm.engine.runner.model) / (hbm_gbs * 1e9) * 1e3
            for batch in BATCH_SIZES:
                ms = measure(llm.engine, batch) * 1e3
                tpot_s, ttft_s = tpot(llm, batch)
                rows.append([name, mode, batch, ms, batch / ms * 1e3, ms / roofline_ms,
                             tpot_s * 1e3, ttft_s * 1e3])
                results.append({"model": name, "mode": mode, "overlap": MODES[mode]["overlap"],
                                "batch_size": batch,
                                "ms_per_step": ms, "tokens_per_s": batch / ms * 1e3,
                                "roofline_ms": roofline_ms, "tpot_ms": tpot_s * 1e3,
                                "ttft_ms": ttft_s * 1e3})
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    print_table(f"decode engine step (bf16; HBM {hbm_gbs:.0f} GB/s)",
                ["model", "mode", "batch", "ms/step", "tok/s", "x weight-read roofline",
                 "tpot ms", "ttft ms"], rows)
    name = "bench_decode" + (f"_{args.label}" if args.label else "")
    # A subset of the models or modes keeps the earlier run's rows of the others.
    write_results(name, {"prompt_len": PROMPT_LEN, "hbm_gbs": hbm_gbs,
                         "decode_steps": DECODE_STEPS, "tpot_tokens": TPOT_TOKENS,
                         "rows": merged_rows(name, results, key=decode_key)})


def decode_key(row: dict) -> tuple:
    return row["model"], row["mode"], row["batch_size"]


def engine_args(mode: str) -> dict:
    """The engine arguments of `mode`, for the bcg on the path."""
    args = dict(MODES[mode])
    if not has_overlapped_steps():
        if args.pop("overlap"):
            raise SystemExit(f"{mode!r} needs a checkout with overlapped steps")
    return args


if __name__ == "__main__":
    main()
