"""Kernels of one bench_offline run (decode + breakable, overlap on), dummy weights: GPU time by kernel."""
import os
import sys
import time

sys.path.insert(0, "bench")
import torch
from torch.profiler import ProfilerActivity, profile

import bench_offline as bo
from bcg.engine.llm import LLM

model = sys.argv[1]
tp = int(sys.argv[2]) if len(sys.argv) > 2 else 1  # session 21: rank 0's kernels at tp2
symm = os.environ.get("SYMM") == "1"
llm = LLM(model=model, load_format="dummy", max_model_len=2048, overlap=True,
          tensor_parallel_size=tp, enable_torch_symm_mem=symm, **bo.MODES["decode + breakable"])
vocab = llm.engine.model_config.vocab_size
requests = bo.workload(vocab)
bo.timed_run(llm, [(p, 2) for p, _ in bo.same_lengths(requests, vocab, seed=1)])
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    start = time.perf_counter()
    run = bo.timed_run(llm, requests)
    wall = time.perf_counter() - start
rows = prof.key_averages()
total = sum(r.device_time_total for r in rows) / 1e6
with open(os.path.join(os.environ.get("OUT", "/tmp"), f"prof_{model}_tp{tp}{'_symm' if symm else ''}.txt"), "w") as f:
    print(f"{model}: wall {wall:.2f} s, {run['generated'] / wall:.0f} out tok/s under the profiler, "
          f"kernel time {total:.2f} s; prefill steps {run['prefill_step_s']:.2f} s decode steps "
          f"{run['decode_step_s']:.2f} s; forwards {run['forwards']}", file=f)
    for r in sorted(rows, key=lambda r: -r.device_time_total)[:30]:
        print(f"{r.device_time_total / 1e6:8.3f} s {r.count:8d}  {r.key[:110]}", file=f)
