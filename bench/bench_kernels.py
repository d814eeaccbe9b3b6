"""Kernels of a decode step's transformer stack, per step and per layer: one eager forward of
one sequence's decode (dummy weights, bf16) under the profiler, its CUDA kernels counted by
name. A decode graph replays the same kernels, so this is the count the graph holds (the
head and sampling run after it, eagerly, in every mode).

To compare two checkouts, run the script of this one with the other first on the path:
`PYTHONPATH=<checkout> python bench/bench_kernels.py --label before`.
Run: python bench/bench_kernels.py [--models qwen3-0.6b qwen3-8b] [--label LABEL]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_offline import release_cuda_memory  # noqa: E402
from common import (  # noqa: E402
    has_overlapped_steps,
    print_table,
    require_cuda,
    synchronize,
    write_results,
)

from bcg.engine.llm import LLM  # noqa: E402
from bcg.engine.sampling_params import SamplingParams  # noqa: E402
from bcg.models.config import ModelConfig  # noqa: E402
from bcg.models.presets import PRESETS  # noqa: E402

PROMPT_LEN = 128


def decode_kernels(model: str) -> Counter[str]:
    """The CUDA kernels of one eager decode forward of the stack, by name."""
    # Plain steps, so the host has every token.
    plain = {"overlap": False} if has_overlapped_steps() else {}
    llm = LLM(model, load_format="dummy", max_model_len=1024, gpu_memory_utilization=0.6,
              enforce_eager=True, **plain)
    engine, runner = llm.engine, llm.engine.runner
    engine.add_request(list(range(1, PROMPT_LEN + 1)),
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()  # the prefill: the sequence now has one token to decode
    [seq] = engine.scheduler.running
    assert engine.scheduler.block_manager.try_allocate(seq, 1)  # its next token's slot
    batch = runner.prepare([seq], [1])
    runner.forward(batch)  # every kernel compiled before the profile
    synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.forward(batch)
        synchronize()
    kernels = Counter(event.name for event in prof.events()
                      if event.device_type == torch.autograd.DeviceType.CUDA)
    llm.engine.abort_request(seq.request_id)
    del llm, engine, runner
    release_cuda_memory()
    return kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b", "qwen3-8b"])
    parser.add_argument("--label", default="", help="suffix of the JSON name (e.g. 'before')")
    args = parser.parse_args()
    require_cuda("bench_kernels")
    rows = []
    for model in args.models:
        kernels = decode_kernels(model)
        layers = ModelConfig.from_hf_dict(PRESETS[model]).num_hidden_layers  # hybrids: by pattern
        total = sum(kernels.values())
        rows.append({"model": model, "kernels_per_step": total, "num_layers": layers,
                     "kernels_per_layer": total / layers, "by_name": dict(kernels.most_common())})
        for name, count in kernels.most_common():
            print(f"{model}: {count:4d}  {name[:110]}")
    print_table("CUDA kernels of one decode forward of the stack (batch 1)",
                ["model", "layers", "kernels/step", "kernels/layer"],
                [[r["model"], r["num_layers"], r["kernels_per_step"], r["kernels_per_layer"]]
                 for r in rows])
    write_results("bench_kernels" + (f"_{args.label}" if args.label else ""), {"rows": rows})


if __name__ == "__main__":
    main()
