"""Decode step time of the engine, eager vs one full CUDA graph per batch size, for the
built-in SmolLM2-135M (GGUF weights) and Qwen3-0.6B / Qwen3-8B with dummy weights, bf16.

Each case starts `batch` requests with 128-token prompts, runs the prefill, then times
`DECODE_STEPS` engine steps in which every request decodes one token: tok/s counts the
tokens of all requests, ms/step is the wall time of one `LLMEngine.step()` (scheduling,
batch building, the eager forward, sampling and detokenization included).

The weight-read roofline of a step is the bytes of weights one forward reads divided by the
measured HBM bandwidth. Run: python bench/bench_decode.py [--models ...]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    decode_weight_bytes,
    hbm_bandwidth_gbs,
    print_table,
    require_cuda,
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
MODES = {
    "eager": {"decode_graph": "none", "prefill_graph": "none"},
    "full graph": {"decode_graph": "full", "prefill_graph": "none"},
}
BATCH_SIZES = [1, 8, 64]
PROMPT_LEN = 128
WARMUP_STEPS = 4
DECODE_STEPS = 32


def measure(engine: LLMEngine, batch: int) -> float:
    """Seconds per decode step with `batch` requests decoding."""
    params = SamplingParams(temperature=0, max_tokens=WARMUP_STEPS + DECODE_STEPS + 2,
                            ignore_eos=True)
    ids = [engine.add_request([(31 * r + 7 * i) % 5000 + 100 for i in range(PROMPT_LEN)], params)
           for r in range(batch)]
    started: set[str] = set()
    while len(started) < batch:  # prefill (possibly chunked) until every request decodes
        started.update(o.request_id for o in engine.step())
    for _ in range(WARMUP_STEPS):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(DECODE_STEPS):
        engine.step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / DECODE_STEPS
    for request_id in ids:
        engine.abort_request(request_id)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    require_cuda("bench_decode")
    hbm_gbs = hbm_bandwidth_gbs()
    rows, results = [], []
    for name in args.models:
        for mode, mode_args in MODES.items():
            llm = LLM(max_model_len=1024, gpu_memory_utilization=0.6,
                      decode_graph_bs=",".join(map(str, BATCH_SIZES)), **MODELS[name],
                      **mode_args)
            roofline_ms = decode_weight_bytes(llm.engine.runner.model) / (hbm_gbs * 1e9) * 1e3
            for batch in BATCH_SIZES:
                ms = measure(llm.engine, batch) * 1e3
                rows.append([name, mode, batch, ms, batch / ms * 1e3, ms / roofline_ms])
                results.append({"model": name, "mode": mode, "batch": batch, "ms_per_step": ms,
                                "tokens_per_s": batch / ms * 1e3, "roofline_ms": roofline_ms})
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    print_table(f"decode engine step (bf16; HBM {hbm_gbs:.0f} GB/s)",
                ["model", "mode", "batch", "ms/step", "tok/s", "x weight-read roofline"], rows)
    write_results("bench_decode", {"prompt_len": PROMPT_LEN, "hbm_gbs": hbm_gbs,
                                   "decode_steps": DECODE_STEPS, "results": results})


if __name__ == "__main__":
    main()
