"""Rank 0's kernels of qwen3-8b decode steps at batch 1 (full decode graph), per config:
python profile_step.py tp1 tp2. Prints µs per step by kernel name, then one step's
timeline (start, duration, gap after the previous kernel's end) for the first 3 layers and
the step's tail."""
import collections
import json
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from bcg.engine.llm import LLM
from bcg.engine.sampling_params import SamplingParams

STEPS = 20
LAYER_NAMES = ["qkv", "rotary", "attention", "o", "norm/ar", "gate_up", "down", "norm/ar"]


def layer_table(step: list) -> list[list[float]]:
    """Per layer, each of its 8 kernels' time from the later of its own start and the
    previous kernel's end to its own end."""
    first = next(i for i, e in enumerate(step) if "rotary" in e["name"]) - 1
    table = []
    for start in range(first, len(step) - 8, 8):
        chunk = step[start - 1:start + 8]
        if "rotary" not in chunk[2]["name"]:
            break
        ends = [e["ts"] + e["dur"] for e in chunk]
        table.append([ends[j] - max(ends[j - 1], chunk[j]["ts"]) for j in range(1, 9)])
    return table

for name in sys.argv[1:]:
    tp = int(name[2:])
    llm = LLM(model="qwen3-8b", load_format="dummy", max_model_len=1024, max_num_seqs=1,
              decode_graph_bs="1", prefill_graph="none", tensor_parallel_size=tp)
    engine = llm.engine
    engine.add_request(list(range(100, 228)), SamplingParams(temperature=0, max_tokens=400,
                                                              ignore_eos=True))
    for _ in range(40):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            engine.step()
        torch.cuda.synchronize()
    path = tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(path)
    events = [e for e in json.load(open(path))["traceEvents"]
              if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    events.sort(key=lambda e: e["ts"])
    stats = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        s = stats[e["name"][:70]]
        s[0] += 1
        s[1] += e["dur"]
    span = (events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"]) / STEPS
    print(f"== {name}: {span:.0f} us per step (first kernel to last), "
          f"{len(events) / STEPS:.0f} kernels per step", flush=True)
    for kernel, (n, t) in sorted(stats.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"{n / STEPS:7.1f}/step {t / n:8.2f} us avg {t / STEPS:9.1f} us/step  {kernel}")
    # one step: the kernels after the 10th argmax up to the next one
    heads = [i for i, e in enumerate(events) if "argmax" in e["name"]]
    first = heads[len(heads) // 2] + 1
    step = events[first:heads[len(heads) // 2 + 1] + 1]
    t0 = step[0]["ts"]
    print(f"-- one step from event {first}: start us, dur us, gap after previous end")
    for i, e in enumerate(step):
        if i < 30 or i > len(step) - 25:
            gap = e["ts"] - step[i - 1]["ts"] - step[i - 1]["dur"] if i else 0.0
            print(f"{e['ts'] - t0:9.1f} {e['dur']:7.2f} {gap:7.2f}  {e['name'][:60]}")
    layers = layer_table(step)
    print("-- median over layers: us from the previous kernel's end (or own start) to own end")
    for j, name_j in enumerate(LAYER_NAMES):
        values = sorted(layer[j] for layer in layers)
        print(f"  {name_j:10s} {values[len(values) // 2]:7.2f}")
    print(f"  {'layer':10s} {sorted(sum(la) for la in layers)[len(layers) // 2]:7.2f}")
    llm.close()
    del llm, engine
    torch.cuda.empty_cache()
