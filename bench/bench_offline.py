"""Offline throughput: a fixed workload through `LLM.generate` per graph mode, and Hugging
Face transformers `generate` on the same architecture as the outside peer.

256 requests, prompt and output lengths uniform in [100, 1024] (fixed seed), greedy,
`ignore_eos` so every request produces its full length; dummy weights in bf16. tok/s counts
prompt + generated tokens over the wall time of the whole run; start-up is the engine's
construction (weights, graph capture, KV cache); each engine first runs a short warm-up
of the same prompt lengths (not timed: see `timed_run`), then `--repeats` timed runs of the
workload's lengths, and the row is the median run. Transformers runs the requests in batches
of `--hf-batch`, left-padded, each batch generating its longest output (only the tokens a
request asked for are counted); `--hf-requests N` times only the first N requests, for a
peer too slow to finish all of them in the time at hand (its row says how many it ran).
A run of some modes keeps the other modes' earlier rows.
Run: python bench/bench_offline.py [--models qwen3-0.6b] [--modes eager ...]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, print_table, require_cuda, write_results  # noqa: E402

from bcg.engine.llm import LLM  # noqa: E402
from bcg.engine.llm_engine import EngineStats  # noqa: E402
from bcg.engine.sampling_params import SamplingParams  # noqa: E402
from bcg.models.presets import PRESETS  # noqa: E402

NUM_REQUESTS = 256
MODES = {
    "eager": {"decode_graph": "none", "prefill_graph": "none"},
    "decode graph": {"decode_graph": "full", "prefill_graph": "none"},
    "decode + breakable": {"decode_graph": "full", "prefill_graph": "breakable"},
    "decode + piecewise": {"decode_graph": "full", "prefill_graph": "piecewise"},
}
HF_MODE = "transformers generate"


def workload(vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab) for _ in range(rng.randint(100, 1024))],
             rng.randint(100, 1024)) for _ in range(NUM_REQUESTS)]


def same_lengths(requests, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """Requests of the same prompt and output lengths with other random tokens: the same work,
    and no prefix-cache hit on an earlier run's prompts."""
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab) for _ in p], n) for p, n in requests]


def run_bcg(model: str, mode: str, requests, repeats: int) -> dict:
    """Start an engine, warm it up, then time `repeats` runs of the workload's lengths (the
    first on the workload itself); the row is the median run."""
    start = time.perf_counter()
    llm = LLM(model=model, load_format="dummy", max_model_len=2048, **MODES[mode])
    startup = time.perf_counter() - start
    vocab = PRESETS[model]["vocab_size"]
    warm_start = time.perf_counter()
    timed_run(llm, [(p, 2) for p, _ in same_lengths(requests, vocab, seed=1)])
    warmup = time.perf_counter() - warm_start
    runs = [timed_run(llm, requests if r == 0 else same_lengths(requests, vocab, seed=1 + r))
            for r in range(repeats)]
    median = sorted(runs, key=lambda run: run["seconds"])[len(runs) // 2]
    kv_cache_tokens = llm.engine.runner.num_kv_blocks * llm.engine.config.block_size
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return {**median, "run_seconds": [run["seconds"] for run in runs], "startup_s": startup,
            "warmup_s": warmup, "kv_cache_tokens": kv_cache_tokens}


def timed_run(llm: LLM, requests) -> dict:
    """One greedy `generate` of the requests, with the engine's counters of that run alone.
    The warm-up is such a run too: Triton compiles a kernel the first time a process meets
    it, and Inductor (piecewise) compiles per bucket, so without it the first mode of a
    process would pay those compiles (seconds) inside its timed run."""
    engine = llm.engine
    engine.stats = EngineStats()
    engine.runner.forward_counts.clear()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"generated": sum(len(o.outputs[0].token_ids) for o in outputs), "seconds": seconds,
            "preemptions": engine.stats.num_preemptions,
            "prefill_step_s": engine.stats.prefill_seconds,
            "decode_step_s": engine.stats.decode_seconds,
            "forwards": dict(engine.runner.forward_counts)}


def hf_config(model: str):
    """The preset as a transformers config, for the same architecture with random weights."""
    from transformers import AutoConfig

    model_types = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                   "Qwen3ForCausalLM": "qwen3"}
    preset = PRESETS[model]
    return AutoConfig.for_model(model_types[preset["architectures"][0]], **preset)


def run_transformers(model: str, requests, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(hf_config(model), dtype=torch.bfloat16).eval()
    startup = time.perf_counter() - start
    torch.cuda.synchronize()
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        chunk = requests[first : first + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk],
                            device="cuda")
        longest = max(n for _, n in chunk)
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                        min_new_tokens=longest, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        print(f"transformers: {first + len(chunk)} requests done after "
              f"{time.perf_counter() - start:.1f} s", flush=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return {"generated": sum(n for _, n in requests), "seconds": seconds, "startup_s": startup}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b", "qwen3-8b"])
    parser.add_argument("--modes", nargs="+", default=[*MODES, HF_MODE],
                        choices=[*MODES, HF_MODE], help="what to run (default: all)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per engine (the row is the median; default 3)")
    parser.add_argument("--hf-batch", type=int, default=128, help="transformers batch size")
    parser.add_argument("--hf-requests", type=int, default=NUM_REQUESTS,
                        help="transformers runs only the first N requests (default: all)")
    args = parser.parse_args()
    require_cuda("bench_offline")
    rows = []
    for model in args.models:
        workload_requests = workload(PRESETS[model]["vocab_size"])
        for mode in args.modes:
            if mode in MODES:
                requests = workload_requests
                r = run_bcg(model, mode, requests, args.repeats)
            else:
                requests = workload_requests[: args.hf_requests]
                r = run_transformers(model, requests, args.hf_batch)
            prompt_tokens = sum(len(p) for p, _ in requests)
            total = prompt_tokens + r["generated"]
            rows.append({"model": model, "mode": mode, **r, "requests": len(requests),
                         "prompt_tokens": prompt_tokens,
                         "tokens_per_s": total / r["seconds"],
                         "output_tokens_per_s": r["generated"] / r["seconds"]})
            print(f"\n{rows[-1]}", flush=True)  # a long run still leaves every finished mode
    print_table(f"offline throughput, {NUM_REQUESTS} requests, lengths uniform in [100, 1024]",
                ["model", "mode", "tok/s (in+out)", "out tok/s", "run s", "start-up s"],
                [[r["model"], r["mode"], r["tokens_per_s"], r["output_tokens_per_s"],
                  r["seconds"], r["startup_s"]] for r in rows])
    for row in rows:  # rows outlive their run (merged_rows): each says where it ran
        row.update(device=torch.cuda.get_device_name(), torch=torch.__version__)
    name = "bench_offline_" + "_".join(args.models)
    write_results(name, {"rows": merged_rows(name, rows)})


def merged_rows(name: str, rows: list[dict]) -> list[dict]:
    """`rows` plus the rows of an earlier run of other (model, mode) pairs, so the modes of a
    model can be run in separate processes (a whole model may not fit one time slot)."""
    path = RESULTS_DIR / f"{name}.json"
    earlier = json.loads(path.read_text())["rows"] if path.exists() else []
    fresh = {(r["model"], r["mode"]) for r in rows}
    return [r for r in earlier if (r["model"], r["mode"]) not in fresh] + rows


if __name__ == "__main__":
    main()
