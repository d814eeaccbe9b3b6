"""Rank 0's kernels of one qwen3-8b decode step at batch 1, full decode graph, per config:
python profile_tp.py tp1 tp2 tp2-custom. Prints kernels per step and µs per step by name."""
import collections
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from bcg.engine.llm import LLM
from bcg.engine.sampling_params import SamplingParams

CONFIGS = {"tp1": {}, "tp2": {"tensor_parallel_size": 2},
           "tp2-custom": {"tensor_parallel_size": 2, "enable_custom_all_reduce": True}}
STEPS = 20
for name in sys.argv[1:]:
    llm = LLM(model="qwen3-8b", load_format="dummy", max_model_len=1024, max_num_seqs=1,
              decode_graph_bs="1", prefill_graph="none", **CONFIGS[name])
    engine = llm.engine
    engine.add_request(list(range(100, 228)), SamplingParams(temperature=0, max_tokens=200,
                                                              ignore_eos=True))
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(STEPS):
        engine.step()
    end.record()
    torch.cuda.synchronize()
    wall = start.elapsed_time(end) * 1e3 / STEPS
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            engine.step()
        torch.cuda.synchronize()
    stats = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            s = stats[e.name[:80]]
            s[0] += 1
            s[1] += e.device_time_total
    total = sum(v[1] for v in stats.values()) / STEPS
    count = sum(v[0] for v in stats.values()) / STEPS
    print(f"== {name}: {wall:.0f} us per step (events), {count:.0f} kernels per step, "
          f"{total:.0f} us kernel time per step", flush=True)
    for kernel, (n, t) in sorted(stats.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"{n / STEPS:7.1f}/step {t / n:8.2f} us avg {t / STEPS:9.1f} us/step  {kernel}")
    llm.close()
    del llm, engine
    torch.cuda.empty_cache()
