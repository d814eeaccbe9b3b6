"""Where a batch-1 decode step of qwen3-0.6b goes on the GPU (dummy weights, full decode
graph, overlapped steps, as bench_decode runs it): kernels by name (µs a step) and the GPU's
idle time between them. python bench/results/s41/profile_step.py"""
import collections, json, os, sys
sys.path.insert(0, ".")
import torch
from torch.profiler import ProfilerActivity, profile
from bcg.engine.llm import LLM
from bcg.engine.sampling_params import SamplingParams

STEPS = 30
out = os.environ.get("OUT", "/tmp")
llm = LLM(model=sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b", load_format="dummy",
          decode_graph="full", prefill_graph="none", overlap=True, max_model_len=1024,
          gpu_memory_utilization=0.6)
engine = llm.llm_engine if hasattr(llm, "llm_engine") else llm.engine
engine.add_request(list(range(100, 228)), SamplingParams(temperature=0, max_tokens=400,
                                                          ignore_eos=True))
for _ in range(40):
    engine.step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    for _ in range(STEPS):
        engine.step()
    torch.cuda.synchronize()
path = f"{out}/step_trace.json"
prof.export_chrome_trace(path)
events = [e for e in json.load(open(path))["traceEvents"]
          if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
events.sort(key=lambda e: e["ts"])
by_name = collections.defaultdict(lambda: [0, 0.0])
for e in events:
    by_name[e["name"][:80]][0] += 1
    by_name[e["name"][:80]][1] += e["dur"]
span = events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"]
busy = sum(e["dur"] for e in events)
gaps = collections.Counter()
for a, b in zip(events, events[1:]):
    gap = b["ts"] - (a["ts"] + a["dur"])
    gaps[(a["name"][:40], b["name"][:40])] += gap
print(f"{len(events)} GPU events over {STEPS} steps: span {span / STEPS:.1f} us a step, "
      f"busy {busy / STEPS:.1f} us, idle {(span - busy) / STEPS:.1f} us")
for name, (n, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
    print(f"  {n / STEPS:5.1f}/step {t / n:8.1f} us each {t / STEPS:8.1f} us/step  {name}")
print("largest idle gaps (us a step) between kernels:")
for (a, b), g in gaps.most_common(8):
    print(f"  {g / STEPS:7.1f}  {a} -> {b}")
