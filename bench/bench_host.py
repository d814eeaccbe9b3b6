"""The engine's host path per decode step: `LLMEngine.step()` with the transformer stack
replaced by a static output, so what is left is the host's work (scheduling, batch building
and upload, the LM head and sampling launches, reading the tokens, stop checks and outputs)
plus the head's and sampler's device time. Not counted: launching the stack itself (a graph
replay and the fill of its inputs). Overlapped steps hide the host only while it is shorter
than the device's step: compare these with `bench_decode`'s step times.

Each case starts `batch` requests with 128-token prompts, prefills them, then times
`STEPS` steps in which every request decodes (`step(finished_only=True)`, as
`LLM.generate` steps), plain and overlapped. On CUDA the model is the preset (dummy
weights, bf16); on the CPU a narrow version of it (hidden 64, vocabulary 8192), so the
head's matmul does not hide the host. JSON rows: `model`, `device`, `overlap`,
`batch_size`, `host_ms_per_step`.
Run: python bench/bench_host.py [--model qwen3-0.6b] [--batch-sizes 1 64 256]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, synchronize, write_results  # noqa: E402

from bcg.engine.llm import LLM  # noqa: E402
from bcg.engine.llm_engine import LLMEngine  # noqa: E402
from bcg.engine.sampling_params import SamplingParams  # noqa: E402
from bcg.models.presets import PRESETS  # noqa: E402

PROMPT_LEN = 128
WARMUP_STEPS = 8
STEPS = 64
CPU_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "vocab_size": 8192}


def engine_for(model: str, device: str, overlap: bool, max_batch: int) -> LLMEngine:
    """An engine whose stack returns a static output (the host path alone remains)."""
    if device == "cpu":  # a temporary narrow preset of the same architecture
        PRESETS[f"{model}-narrow"] = {**PRESETS[model], **CPU_SHAPE}
        model = f"{model}-narrow"
    max_model_len = PROMPT_LEN + WARMUP_STEPS + STEPS + 16
    llm = LLM(model, load_format="dummy", device=device, overlap=overlap,
              max_num_seqs=max_batch, max_model_len=max_model_len,
              kv_cache_tokens=max_batch * max_model_len,
              decode_graph="none", prefill_graph="none")
    engine = llm.engine
    hidden = torch.zeros(max(max_batch, 2048), PRESETS[model]["hidden_size"],
                         dtype=engine.runner.dtype, device=device)
    engine.runner.forward = lambda batch: hidden[: batch.num_tokens]
    return engine


def host_ms_per_step(engine: LLMEngine, batch: int) -> float:
    """Milliseconds per engine step with `batch` requests decoding."""
    rng = random.Random(batch)
    params = SamplingParams(temperature=0, max_tokens=WARMUP_STEPS + STEPS + 8, ignore_eos=True)
    ids = [engine.add_request([rng.randrange(100, 4000) for _ in range(PROMPT_LEN)], params)
           for _ in range(batch)]
    while any(seq.num_computed_tokens < PROMPT_LEN for seq in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step(finished_only=True)
    for _ in range(WARMUP_STEPS):
        engine.step(finished_only=True)
    synchronize()
    start = time.perf_counter()
    for _ in range(STEPS):
        engine.step(finished_only=True)
    synchronize()
    seconds = (time.perf_counter() - start) / STEPS
    for request_id in ids:
        engine.abort_request(request_id)
    engine.step(finished_only=True)  # any step still in flight completes
    return seconds * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b", choices=list(PRESETS))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    rows = []
    for overlap in (False, True):
        engine = engine_for(args.model, args.device, overlap, max(args.batch_sizes))
        for batch in args.batch_sizes:
            rows.append({"model": args.model, "device": args.device, "overlap": overlap,
                         "batch_size": batch, "host_ms_per_step": host_ms_per_step(engine,
                                                                                   batch)})
        engine.close()
    print_table(f"host path per decode step ({args.model}, {args.device}; stack replaced)",
                ["model", "overlap", "batch", "host ms/step"],
                [[r["model"], "on" if r["overlap"] else "off", r["batch_size"],
                  r["host_ms_per_step"]] for r in rows])
    write_results(f"bench_host_{args.device}", {"prompt_len": PROMPT_LEN, "steps": STEPS,
                                                 "rows": rows})


if __name__ == "__main__":
    main()
