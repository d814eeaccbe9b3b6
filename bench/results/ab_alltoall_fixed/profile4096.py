"""ep2-alltoall 1x4096 prefill step (counted exchange) under the profiler on rank 0: eager,
breakable, piecewise. Per mode: wall ms per step, GPU kernel ms per step, the top kernels,
and the host ops that wait (item/tolist)."""
import collections, sys, time
sys.path.insert(0, "bench")
import torch
from torch.profiler import ProfilerActivity, profile
import model_suite as suite
import bench_moe
from bench_offline import on_engine
from collections import Counter

STEPS = 3
base = bench_moe.SETUPS["ep2-alltoall"].engine_args

def measure(llm):
    engine = llm.engine
    for seed in range(3):
        suite.prefill_step_ms(engine, 1, 4096, seed, Counter())
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        walls = [suite.prefill_step_ms(engine, 1, 4096, 10 + i, Counter()) for i in range(STEPS)]
    gpu = collections.defaultdict(lambda: [0, 0.0])
    cpu = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            s = gpu[e.name[:80]]; s[0] += 1; s[1] += e.device_time_total
        else:
            s = cpu[e.name[:80]]; s[0] += 1; s[1] += e.cpu_time_total
    total = sum(v[1] for v in gpu.values()) / STEPS / 1e3
    print(f"wall ms/step {sum(walls)/STEPS:.1f} (under profiler), kernel ms/step {total:.1f}, kernels/step {sum(v[0] for v in gpu.values())/STEPS:.0f}")
    for name, (n, t) in sorted(gpu.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"  gpu {n/STEPS:7.1f}/step {t/STEPS/1e3:8.2f} ms/step  {name}")
    for name in ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaGraphLaunch", "aten::tolist", "cudaMemcpyAsync", "cudaLaunchKernel", "cudaDeviceSynchronize"):
        if name in cpu:
            n, t = cpu[name]
            print(f"  cpu {n/STEPS:7.1f}/step {t/STEPS/1e3:8.2f} ms/step  {name}")
    return None

for mode in ("eager", "breakable", "piecewise"):
    print(f"== {mode}", flush=True)
    on_engine(measure, **suite.prefill_engine_args(base, mode, [(1, 4096)]))
