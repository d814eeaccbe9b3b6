"""Session 33's probe of the intermittent slow tp2 decode at batch 64 (NEXT.md item 2): the
wall time of every engine step of a qwen3-8b decode at batch 64, tp1 and tp2, several
rounds of bench_decode's measurement each, so one slow round shows whether a few steps
stall (a host pause) or every step is slower (a device state).
Run from the repository root: python bench/results/s32/step_times_probe.py [rounds] [model]
[sizes] (session 33 added the model: nemotron-h-8b showed the slow runs twice there;
session 35 the tensor-parallel sizes, comma-separated, default 1,2: e.g. 2,4 on four GPUs)
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bcg.engine.llm import LLM  # noqa: E402
from bcg.engine.sampling_params import SamplingParams  # noqa: E402
from bench.bench_decode import prompts  # noqa: E402

BATCH, STEPS = 64, 32


def step_times(llm: LLM, seed: str) -> list[float]:
    """Milliseconds of each of `STEPS` decode steps with `BATCH` requests decoding."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=STEPS + BATCH + 8, ignore_eos=True)
    ids = [engine.add_request(prompt, params) for prompt in prompts(BATCH, seed)]
    started: set[str] = set()
    while len(started) < BATCH:
        started.update(o.request_id for o in engine.step())
    for _ in range(4):
        engine.step()
    times = []
    for _ in range(STEPS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    for request_id in ids:
        engine.abort_request(request_id)
    return times


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    model = sys.argv[2] if len(sys.argv) > 2 else "qwen3-8b"
    sizes = [int(size) for size in sys.argv[3].split(",")] if len(sys.argv) > 3 else [1, 2]
    for tp in sizes:
        llm = LLM(model, load_format="dummy", dtype="bfloat16", tensor_parallel_size=tp,
                  max_model_len=1024, max_num_seqs=BATCH, decode_graph_bs=str(BATCH),
                  prefill_graph="none")
        for round_index in range(rounds):
            times = step_times(llm, f"round {round_index}")
            median = statistics.median(times)
            slow = [f"{i}:{t:.2f}" for i, t in enumerate(times) if t > 1.3 * median]
            print(f"tp{tp} round {round_index}: mean {statistics.mean(times):.3f} median "
                  f"{median:.3f} min {min(times):.3f} max {max(times):.3f} ms; steps over "
                  f"1.3x the median: {slow or 'none'}", flush=True)
        llm.close()


if __name__ == "__main__":
    main()
