"""Eager decode throughput of the engine (no CUDA graphs), for the built-in SmolLM2-135M
(GGUF weights) and Qwen3-0.6B with dummy weights, bf16 on one GPU.

Each case starts `batch` requests with 128-token prompts, runs the prefill, then times
`DECODE_STEPS` engine steps in which every request decodes one token: tok/s counts the
tokens of all requests, ms/step is the wall time of one `LLMEngine.step()` (scheduling,
batch building, the eager forward, sampling and detokenization included).

Run: python bench/bench_decode_eager.py
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, require_cuda, write_results  # noqa: E402

from bcg.engine.llm import LLM  # noqa: E402
from bcg.engine.llm_engine import LLMEngine  # noqa: E402
from bcg.engine.sampling_params import SamplingParams  # noqa: E402

MODELS = {  # name -> LLM arguments
    "smollm2-135m (GGUF)": {},
    "qwen3-0.6b (dummy)": {"model": "qwen3-0.6b", "load_format": "dummy"},
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
    require_cuda("bench_decode_eager")
    rows, results = [], []
    for name, args in MODELS.items():
        llm = LLM(max_model_len=1024, gpu_memory_utilization=0.5, **args)
        for batch in BATCH_SIZES:
            seconds = measure(llm.engine, batch)
            rows.append([name, batch, seconds * 1e3, batch / seconds])
            results.append({"model": name, "batch": batch, "ms_per_step": seconds * 1e3,
                            "tokens_per_s": batch / seconds})
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    print_table("Eager decode (bf16, no CUDA graphs)", ["model", "batch", "ms/step", "tok/s"],
                rows)
    write_results("bench_decode_eager", {"prompt_len": PROMPT_LEN,
                                         "decode_steps": DECODE_STEPS, "results": results})


if __name__ == "__main__":
    main()
