"""Session 22 plan item 4: kernels of one 2048-token prefill step (4 prompts of 512, as
bench_offline's prefill steps mostly are), qwen3-8b dummy, breakable graphs, against the
same step's matmuls alone. GPU time by kernel name (the graph's kernels are named by the
profiler on replay), so the non-GEMM share of a ~53 ms offline prefill step shows."""
import collections
import dataclasses
import functools
import sys

sys.path.insert(0, "bench")
import torch
from torch.profiler import ProfilerActivity, profile

import bench_prefill as bp
from bcg.runner.prefill_graph import PrefillGraphRunner

model = sys.argv[1] if len(sys.argv) > 1 else "qwen3-8b"
with torch.inference_mode():
    runner, config = bp.make_runner(model)
    config = dataclasses.replace(config, prefill_graph_tokens="2048")
    prefill = PrefillGraphRunner.from_config(runner.stack_spec,
                                             dataclasses.replace(config, prefill_graph="breakable"))
    prefill.capture_all()
    runner.graph_runners = [prefill]
    batch = bp.make_batch(runner, 4, 2048)
    step = functools.partial(bp.prefill_step, runner.forward, runner, batch)
    alone = bp.matmuls_alone_step(runner.model, 4, 2048)
    for name, fn in (("breakable step", step), ("matmuls alone", alone)):
        print(f"{name}: {bp.time_per_call_ms(fn, 10):.2f} ms", flush=True)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    stats = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.key_averages():
        stats[event.key[:100]] = [event.count, event.device_time_total]
    total = sum(t for _, t in stats.values()) / 5
    print(f"{model}: {total / 1e3:.2f} ms of kernels a step")
    for name, (count, t) in sorted(stats.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"{count / 5:6.1f}/step {t / 5 / 1e3:8.3f} ms/step  {name}")
