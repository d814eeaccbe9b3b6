"""Session 36's probe of issue 18's open question: s26's PDL run cut qwen3-0.6b's decode
step (bench_decode's step loop) from 1.180 to 1.123 ms, but its tpot through `LLM.generate`
stayed at 1.16 ms. Which bounds the generate path at batch 1: the host, the GPU, or the
longer contexts of the tpot measurement (prompt 128, then 256 tokens) than the step loop's?

For `LLM.generate` of one prompt at several prompt lengths, every `LLMEngine.step` call is
timed on the host, and a CUDA event recorded after it marks when the GPU had done that
step's work: the events' intervals are the GPU's period per step (its busy time plus any
wait for the host), the host's intervals its wall time per step. A profiled generate then
gives the kernels' busy time per step. GPU period ≈ busy time: the GPU bounds the step;
GPU period > busy time: the GPU waits (for the host, or between kernels).

Run from the repository root on one GPU:
python bench/results/s36/tpot_probe.py [model] [tokens]   (default qwen3-0.6b 256)
On the CPU it runs the built-in SmolLM2 (a check of the script), without the GPU columns.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from bcg.engine.llm import LLM  # noqa: E402
from bcg.engine.sampling_params import SamplingParams  # noqa: E402

PROMPT_LENS = (16, 128, 512)
SKIP = 4  # first and last steps left out of the medians (prefill, ramp, the tail)


def timed_generate(llm: LLM, prompt_len: int, tokens: int) -> tuple[list[float], list]:
    """Host timestamps after every engine step of one generate, and a CUDA event after each."""
    engine, step = llm.engine, llm.engine.step
    stamps, events = [], []

    def timed_step(*args, **kwargs):
        outputs = step(*args, **kwargs)
        stamps.append(time.perf_counter())
        if torch.cuda.is_available():
            events.append(torch.cuda.Event(enable_timing=True))
            events[-1].record()
        return outputs

    engine.step = timed_step
    try:
        prompt = [100 + (i * 7) % 5000 for i in range(prompt_len)]
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=tokens,
                                              ignore_eos=True), use_tqdm=False)
    finally:
        del engine.step
    if events:
        torch.cuda.synchronize()
    return stamps, events


def median_interval_ms(values: list[float]) -> float:
    steady = values[SKIP:-SKIP]
    return statistics.median(b - a for a, b in zip(steady, steady[1:])) * 1e3


def kernel_ms_per_step(llm: LLM, prompt_len: int, tokens: int) -> float | None:
    """CUDA kernel time per engine step of a profiled generate (None without a GPU)."""
    if not torch.cuda.is_available():
        return None
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        stamps, _ = timed_generate(llm, prompt_len, tokens)
    busy_us = sum(e.device_time_total for e in prof.key_averages())
    return busy_us / 1e3 / len(stamps)


def main() -> None:
    on_gpu = torch.cuda.is_available()
    model = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] else (
        "qwen3-0.6b" if on_gpu else None)
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    args = ({"load_format": "dummy", "gpu_memory_utilization": 0.6, "decode_graph_bs": "1"}
            if on_gpu else {"device": "cpu", "kv_cache_tokens": 2048})
    llm = LLM(model, max_model_len=1024, **args)
    timed_generate(llm, 16, 16)  # warm-up
    print(f"{model or 'SmolLM2'}, batch 1, {tokens} tokens a generate; ms per engine step (medians)")
    print(f"{'prompt':>6} {'host wall':>10} {'GPU period':>11} {'kernels busy':>13}")
    for prompt_len in PROMPT_LENS:
        stamps, events = timed_generate(llm, prompt_len, tokens)
        gpu = (statistics.median(a.elapsed_time(b) for a, b in
                                 zip(events[SKIP:-SKIP], events[SKIP + 1:-SKIP]))
               if events else None)
        busy = kernel_ms_per_step(llm, prompt_len, tokens)
        print(f"{prompt_len:>6} {median_interval_ms(stamps):>10.3f} "
              f"{'-' if gpu is None else f'{gpu:.3f}':>11} "
              f"{'-' if busy is None else f'{busy:.3f}':>13}")


if __name__ == "__main__":
    main()
