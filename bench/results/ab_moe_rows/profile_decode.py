"""Kernels of one decode step at batch 1 (qwen3-0.6b and qwen3-8b, dummy weights, full graph off so kernels are named)."""
import sys, os, json, collections
sys.path.insert(0, "bench")
import torch
from torch.profiler import profile, ProfilerActivity
from bcg.engine.llm import LLM
from bcg.engine.sampling_params import SamplingParams
out = os.environ.get("OUT", "/tmp")
for model in sys.argv[1:]:
    llm = LLM(model=model, load_format="dummy", decode_graph="none", prefill_graph="none", overlap=False)
    engine = llm.engine if hasattr(llm, "engine") else llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    engine.add_request(list(range(100, 228)), params)
    for _ in range(8):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            engine.step()
        torch.cuda.synchronize()
    stats = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            s = stats[e.name[:90]]; s[0] += 1; s[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    total = sum(v[1] for v in stats.values()) / 4
    count = sum(v[0] for v in stats.values()) / 4
    print(f"== {model}: {count:.0f} kernels per step, {total:.0f} us GPU time per step")
    for name, (n, t) in sorted(stats.items(), key=lambda kv: -kv[1][1]):
        print(f"{n/4:7.1f}/step {t/n:8.2f} us avg {t/4:9.1f} us/step  {name}")
    del llm, engine
    torch.cuda.empty_cache()
