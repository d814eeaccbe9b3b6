"""Offline throughput: a fixed workload through `LLM.generate` per graph mode, and Hugging
Face transformers on the same architecture as the outside peers: its `generate` and its
continuous batching.

256 requests, prompt and output lengths uniform in [100, 1024] (fixed seed), greedy,
`ignore_eos` so every request produces its full length; dummy weights in bf16. Output tok/s
is counted as nano-vllm counts it: the sum of the requests' max_tokens over the wall time of
the timed run (a run that generated any other number of tokens is an error); tok/s counts
prompt + generated tokens over the same time. Start-up is the engine's construction
(weights, graph capture, KV cache; `startup_steps` has the seconds of each part on rank 0,
where waiting for other ranks shows in the parts with collectives); each engine first runs a
short warm-up of the same prompt lengths (not timed: see `timed_run`), then `--repeats`
timed runs of the workload's lengths, and the row is the median run. Transformers `generate`
runs the requests in batches of `--hf-batch`, left-padded, each batch generating its longest
output (only the tokens a request asked for are counted). Transformers continuous batching
runs the manager behind `generate_batch` (paged KV cache, CUDA graphs on; flash attention if
installed, else SDPA), each request with its own max_new_tokens (`generate_batch` takes one
for all requests), after a warm-up like the engines'; one timed run. `--hf-requests N` gives
the transformers modes only the first N requests, for a peer too slow to finish all of them
in the time at hand (its row says how many it ran; rates stay comparable). A run of some
modes keeps the other modes' earlier rows.
Run: python bench/bench_offline.py [--models qwen3-0.6b] [--modes eager ...]
"""

from __future__ import annotations

import argparse
import functools
import gc
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    merged_rows,
    print_table,
    require_cuda,
    synchronize,
    write_results,
)

from bcg.distributed.parallel_state import tensor_parallel  # noqa: E402
from bcg.distributed.symm_mem import SymmMemAllReduce  # noqa: E402
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
HF_GENERATE = "transformers generate"
HF_CONTINUOUS = "transformers continuous batching"
T = TypeVar("T")


def workload(vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab) for _ in range(rng.randint(100, 1024))],
             rng.randint(100, 1024)) for _ in range(NUM_REQUESTS)]


def output_tokens(requests) -> int:
    """The tokens the requests ask for (their max_tokens summed): nano-vllm's output count."""
    return sum(n for _, n in requests)


def same_lengths(requests, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """Requests of the same prompt and output lengths with other random tokens: the same work,
    and no prefix-cache hit on an earlier run's prompts."""
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab) for _ in p], n) for p, n in requests]


def run_bcg(model: str, mode: str, requests, repeats: int, **engine_args) -> dict:
    """Start an engine of `mode` (`engine_args`, e.g. overlap or tensor_parallel_size, added
    to or replacing the mode's), warm it up, then time `repeats` runs of the workload's
    lengths (the first on the workload itself); the row is the median run."""
    args = {"model": model, "load_format": "dummy", "max_model_len": 2048, **MODES[mode],
            **engine_args}
    run, startup = on_engine(functools.partial(time_workload, requests=requests,
                                               repeats=repeats), **args)
    return {**run, "startup_s": startup}


def time_workload(llm: LLM, requests, repeats: int) -> dict:
    """`run_bcg`'s runs on a started engine: the warm-up, then the median of `repeats`."""
    vocab = llm.engine.model_config.vocab_size
    warm_start = time.perf_counter()
    timed_run(llm, [(p, 2) for p, _ in same_lengths(requests, vocab, seed=1)])
    warmup = time.perf_counter() - warm_start
    runs = [timed_run(llm, requests if r == 0 else same_lengths(requests, vocab, seed=1 + r))
            for r in range(repeats)]
    median = sorted(runs, key=lambda run: run["seconds"])[len(runs) // 2]
    kv_cache_tokens = llm.engine.runner.num_kv_blocks * llm.engine.config.block_size
    return {**median, "run_seconds": [run["seconds"] for run in runs], "warmup_s": warmup,
            "kv_cache_tokens": kv_cache_tokens, "startup_steps": llm.engine.startup_seconds,
            "custom_all_reduce": custom_all_reduce_active()}


def custom_all_reduce_active() -> str | None:
    """Which kernel the live engine's small all-reduces go through: "symm-mem" where
    --enable-torch-symm-mem took effect, "custom" where the custom all-reduce (the default
    at several GPUs) did, or the first fell back to it, None for the group's backend (each
    falls back, logged, where it cannot run)."""
    kernel = tensor_parallel().custom_all_reduce
    if kernel is None:
        return None
    return "symm-mem" if isinstance(kernel, SymmMemAllReduce) else "custom"


def on_engine(measure: Callable[[LLM], T], **llm_args) -> tuple[T, float]:
    """`measure(llm)` on a new `LLM(**llm_args)`, and the seconds the engine took to start.
    The engine is closed (its tensor-parallel workers end: only one group can exist at a
    time) and its memory handed back before this returns, so the next engine of the process
    starts with the whole GPU."""
    start = time.perf_counter()
    llm = LLM(**llm_args)
    startup = time.perf_counter() - start
    try:
        return measure(llm), startup
    finally:
        llm.close()
        del llm
        release_cuda_memory()


def timed_run(llm: LLM, requests) -> dict:
    """One greedy `generate` of the requests, with the engine's counters of that run alone.
    The warm-up is such a run too: Triton compiles a kernel the first time a process meets
    it, and Inductor (piecewise) compiles per bucket, so without it the first mode of a
    process would pay those compiles (seconds) inside its timed run."""
    engine = llm.engine
    engine.stats = EngineStats()
    engine.runner.forward_counts.clear()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    synchronize()
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


def hf_model(model: str):
    """Transformers' model of the preset's architecture with random bf16 weights, and the
    seconds its construction took."""
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(hf_config(model), dtype=torch.bfloat16).eval()
    return hf, time.perf_counter() - start


def release_cuda_memory() -> None:
    """Hand a finished run's memory back, so the next mode of the process starts with all
    (compiled code, a piecewise engine's, holds on to its model until dynamo is reset)."""
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


def run_transformers(model: str, requests, batch_size: int) -> dict:
    hf, startup = hf_model(model)
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
    release_cuda_memory()
    return {"generated": output_tokens(requests), "seconds": seconds, "startup_s": startup}


def run_transformers_continuous(model: str, requests) -> dict:
    hf, build_s = hf_model(model)
    row = continuous_batching_run(hf, requests, PRESETS[model]["vocab_size"])
    row["startup_s"] += build_s
    del hf
    release_cuda_memory()
    return row


def continuous_batching_run(hf, requests, vocab: int) -> dict:
    """Transformers' continuous batching on `hf`: start its manager (paged KV cache, CUDA
    graphs forced on; it picks flash attention when installed), warm it up like the engines,
    then time one run of the requests. `startup_s` is the manager's start (cache, graphs)."""
    try:
        from transformers.generation import ContinuousBatchingConfig, GenerationConfig
    except ImportError as error:
        import transformers

        raise RuntimeError(f"{HF_CONTINUOUS} needs a transformers with ContinuousBatchingConfig "
                           f"(written for 5.17 to 5.23); this one is {transformers.__version__}: "
                           "pip install 'transformers>=5.17'") from error
    start = time.perf_counter()
    with hf.continuous_batching_context_manager(
            generation_config=GenerationConfig(do_sample=False),
            # Its cache would take 90% of the free memory, leaving its graphs and cuBLAS none.
            continuous_batching_config=ContinuousBatchingConfig(
                use_cuda_graph=True, max_memory_percent=0.7)) as manager:
        startup = time.perf_counter() - start
        warm_start = time.perf_counter()
        continuous_batching_generate(manager, [(p, 2) for p, _ in same_lengths(requests, vocab, 1)])
        warmup = time.perf_counter() - warm_start
        # Results reach the host after their step's GPU work: no device sync is needed here.
        start = time.perf_counter()
        generated = continuous_batching_generate(manager, requests)
        seconds = time.perf_counter() - start
        varlen_graphs, decode_graphs = manager.continuous_batching_config.cuda_graph_booleans
        return {"generated": generated, "seconds": seconds, "startup_s": startup,
                "warmup_s": warmup, "attention": hf.config._attn_implementation,
                "cuda_graphs": {"varlen": varlen_graphs, "decode": decode_graphs}}


def continuous_batching_generate(manager, requests) -> int:
    """Run the requests through a started transformers continuous-batching manager, each with
    its own max_new_tokens and no EOS (-1 matches no token); the number of tokens generated."""
    pending = {manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in requests}
    if None in pending:
        raise RuntimeError("transformers' continuous batching refused a request: see its log")
    generated = 0
    while pending:
        result = manager.get_result(timeout=1)
        if result is None and not manager.is_running():
            raise RuntimeError("transformers' continuous batching stopped with requests pending: "
                               "see its log")
        if result is None or not result.is_finished():
            continue
        if result.error is not None:
            raise RuntimeError(f"transformers request {result.request_id} failed: {result.error}")
        pending.discard(result.request_id)
        generated += len(result.generated_tokens)
    return generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b", "qwen3-8b"])
    parser.add_argument("--modes", nargs="+", default=[*MODES, HF_GENERATE, HF_CONTINUOUS],
                        choices=[*MODES, HF_GENERATE, HF_CONTINUOUS],
                        help="what to run (default: all)")
    parser.add_argument("--overlap", nargs="+", default=["on", "off"], choices=["on", "off"],
                        help="run each bcg mode with overlapped steps, plain ones, or both "
                        "(default: both, side by side)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per engine (the row is the median; default 3)")
    parser.add_argument("--hf-batch", type=int, default=128,
                        help="transformers generate's batch size")
    parser.add_argument("--hf-requests", type=int, default=NUM_REQUESTS,
                        help="the transformers modes run only the first N requests (default: all)")
    args = parser.parse_args()
    require_cuda("bench_offline")
    name = "bench_offline_" + "_".join(args.models)
    rows = []
    for model in args.models:
        workload_requests = workload(PRESETS[model]["vocab_size"])
        for mode in args.modes:
            requests = workload_requests if mode in MODES else workload_requests[: args.hf_requests]
            for overlap in [o == "on" for o in args.overlap] if mode in MODES else [None]:
                if mode in MODES:
                    r = run_bcg(model, mode, requests, args.repeats, overlap=overlap)
                elif mode == HF_GENERATE:
                    r = run_transformers(model, requests, args.hf_batch)
                else:
                    r = run_transformers_continuous(model, requests)
                # Rows outlive their run (merged_rows): each says where it ran.
                rows.append({**throughput_row(model, mode, requests, r, overlap),
                             "device": torch.cuda.get_device_name(), "torch": torch.__version__})
                print(f"\n{rows[-1]}", flush=True)
                # Written after every mode: a later mode that fails or runs out of time keeps
                # the finished ones.
                write_results(name, {"rows": merged_rows(name, rows, offline_key)})
    print_table(f"offline throughput, {NUM_REQUESTS} requests, lengths uniform in [100, 1024]",
                ["model", "mode", "overlap", "requests", "tok/s (in+out)", "out tok/s", "run s",
                 "start-up s"],
                [[r["model"], r["mode"], {True: "on", False: "off"}.get(r["overlap"], "-"),
                  r["requests"], r["tokens_per_s"], r["output_tok_s"], r["seconds"],
                  r["startup_s"]] for r in rows])


def throughput_row(model: str, mode: str, requests, run: dict,
                   overlap: bool | None = None) -> dict:
    """A mode's row: its run's facts and its rates over the run's wall time; `overlap`
    whether a bcg engine overlapped its steps (None for the transformers peers)."""
    asked = output_tokens(requests)
    if run["generated"] != asked:  # the output rate counts max_tokens, so they must all run
        raise RuntimeError(f"{mode} generated {run['generated']} tokens where the requests "
                           f"asked for {asked}: its output tok/s would be wrong")
    prompt_tokens = sum(len(p) for p, _ in requests)
    return {"model": model, "mode": mode, "overlap": overlap, **run, "requests": len(requests),
            "prompt_tokens": prompt_tokens,
            "tokens_per_s": (prompt_tokens + run["generated"]) / run["seconds"],
            "output_tok_s": asked / run["seconds"]}


def offline_key(row: dict) -> tuple:
    return row["model"], row["mode"], row["overlap"]


if __name__ == "__main__":
    main()
