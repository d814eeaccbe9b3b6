"""The fused decode stack alone on qwen3-30b-a3b's layer shapes (LAYERS of its 48 layers,
random weights and routing, one sequence of CONTEXT tokens), in a CUDA graph of REPEAT
launches: µs a launch and a layer, and a phase-by-phase trace (program 0's clock as it leaves
each grid barrier: a phase's time includes the wait for the slowest program). The trace
comes from a copy of the kernel with time stamps written after each barrier (made here by
editing the source text), so the timed kernel is the tree's. Call f's version: the mixture
(with the top-k that ranks against 16 experts at a time) with weight chunks in registers, or
its QKV chunks pipelined through shared memory; timed twice, then traced. (Call b's version
timed a dense layer of the mixture's sizes, call c's 3, 4 and 6 stages everywhere, call d's
traced the mixture without its top-k and timed qwen3-0.6b beside main.)
python bench/results/s42/stack_micro.py [CONTEXT] [LAYERS]"""
import importlib.util
import re
import sys

import torch

sys.path.insert(0, ".")
import bcg.kernels.decode_stack as m  # noqa: E402
from bcg.kernels.decode_stack import StackShape  # noqa: E402

CONTEXT = int(sys.argv[1]) if len(sys.argv) > 1 else 256
LAYERS = int(sys.argv[2]) if len(sys.argv) > 2 else 8
REPEAT = 10
dev = torch.device("cuda")
MOE = StackShape(LAYERS, 2048, 32, 4, 128, 768, True, 128, 8, True)


def traced_module(no_top_k=False):
    """decode_stack.py with a time stamp after every grid barrier (program 0 only); with
    `no_top_k`, the first 8 experts in place of the router's top-k (to time it)."""
    source = open(m.__file__).read()
    if no_top_k:
        source = source.replace("""            ids, weights = _routed(logits_ptr, NUM_EXPERTS, TOP_K, RENORMALIZE, EXPERTS_P2,
                                   TOP_K_P2)""", """            ids = expert_slots
            weights = tl.full([TOP_K_P2], 0.125, tl.float32)""")
    source = source.replace("partial_lse_ptr, arrivals_ptr, eps, scale_log2,",
                            "partial_lse_ptr, arrivals_ptr, trace_ptr, eps, scale_log2,")
    source = source.replace("workspace.plan.partial_lse, workspace.plan.arrivals),",
                            "workspace.plan.partial_lse, workspace.plan.arrivals, TRACE),")
    source = source.replace("    w_qkv = _weight(weight_table, 0, 0, dtype)\n",
                            "    stamp = 0\n    w_qkv = _weight(weight_table, 0, 0, dtype)\n")
    source = re.sub(r"\n( +)_wait_for_all\(barrier_ptr, target\)\n",
                    lambda g: (f"\n{g[1]}_wait_for_all(barrier_ptr, target)\n"
                               f"{g[1]}if pid == 0:\n{g[1]}    tl.store(trace_ptr + stamp, "
                               f"_clock())\n{g[1]}stamp += 1\n"), source)
    source += '''

@triton.jit
def _clock():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)
'''
    name = "decode_stack_traced" + ("_no_top_k" if no_top_k else "")
    path = f"/tmp/{name}.py"
    open(path, "w").write(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look it up)
    spec.loader.exec_module(module)
    module.TRACE = torch.zeros(8 * LAYERS, dtype=torch.int64, device=dev)
    return module


def weights(shape):
    torch.manual_seed(0)
    h, q = shape.hidden, shape.num_heads * shape.head_dim

    def randn(*size):
        return torch.randn(*size, device=dev, dtype=torch.bfloat16) * 0.02

    rows = []
    for _ in range(shape.num_layers):
        if shape.moe:
            mlp = [randn(shape.num_experts, 2 * shape.intermediate, h),
                   randn(shape.num_experts, h, shape.intermediate)]
            router = randn(shape.num_experts, h) * 50
        else:
            mlp = [randn(2 * shape.intermediate, h), randn(h, shape.intermediate)]
            router = mlp[0]
        rows.append([randn(shape.qkv_size, h), randn(h, q), *mlp]
                    + [torch.ones(n, device=dev, dtype=torch.bfloat16)
                       for n in (h, h, shape.head_dim, shape.head_dim)] + [router])
    return rows


def run(name, shape, module, make_weights=weights):
    W = make_weights(shape)
    table = torch.tensor([[w.data_ptr() for w in row] for row in W], dtype=torch.int64,
                         device=dev)
    blocks = 8192 // 16
    storage = torch.randn(2, shape.num_layers, blocks, 16, shape.num_kv_heads, 128, device=dev,
                          dtype=torch.bfloat16)
    cos, sin = torch.randn(8192, 64, device=dev), torch.randn(8192, 64, device=dev)
    positions = torch.tensor([CONTEXT - 1], device=dev)
    slots = torch.tensor([CONTEXT - 1], device=dev)
    seq_lens = torch.tensor([CONTEXT], device=dev, dtype=torch.int32)
    block_tables = torch.arange(blocks, device=dev, dtype=torch.int32)[None]
    hidden = torch.randn(1, shape.hidden, device=dev, dtype=torch.bfloat16)
    ws = module.make_workspace(shape, torch.bfloat16, dev)
    launch = lambda: module.decode_stack(hidden, positions, slots, seq_lens, block_tables,  # noqa
                                         table, storage, cos, sin, ws, shape, 1e-6)
    hidden0 = hidden.clone()
    launch(); torch.cuda.synchronize()
    if hasattr(module, "TRACE"):
        stamps = []
        for _ in range(5):
            launch(); torch.cuda.synchronize()
            stamps.append(module.TRACE.clone())
        t = torch.stack(stamps).double()
        phases = shape.phases
        per = (t[:, 1:phases * (LAYERS - 1) + 1] - t[:, :phases * (LAYERS - 1)]) / 1000
        per = per.view(5, LAYERS - 1, phases).mean(1).median(0).values
        print(f"trace {name:14s} µs a layer by phase (ending at barrier 1..{phases}): "
              + " ".join(f"{v:5.2f}" for v in per.tolist()) + f"  sum {per.sum():.2f}",
              flush=True)
        return
    first = hidden.clone()
    hidden.copy_(hidden0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEAT):
            launch()
    graph.replay(); torch.cuda.synchronize()
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); graph.replay(); b.record(); torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / REPEAT)
    k = next(iter(module._launch.compiled.values()))
    print(f"ctx {CONTEXT:5d} {name:14s} {min(times):8.1f} us/launch  "
          f"{min(times) / LAYERS:6.2f} us/layer  regs {k.n_regs} spills {k.n_spills}", flush=True)
    return first


def with_stages(module, stages=None, qkv_chunk=8192):
    """The kernel with `stages` (projection -> pipeline stages; 0 for the others) and QKV
    chunks of `qkv_chunk` weights."""
    module.PIPELINE_STAGES = {**{k: 0 for k in module.PIPELINE_STAGES}, **(stages or {})}
    module.CHUNK_ELEMENTS = {**module.CHUNK_ELEMENTS, "qkv": qkv_chunk}
    module._constexprs.cache_clear()
    module._launch = module.CachedLauncher(module._decode_stack_kernel)
    return module


traced = traced_module()
VARIANTS = {"moe registers": ({}, 8192), "moe qkv 3 stages of 512": ({"qkv": 3}, 32768),
            "moe qkv 2 stages of 512": ({"qkv": 2}, 32768)}
for round in range(2):
    reference = None
    for name, (stages, chunk) in VARIANTS.items():
        out = run(name, MOE, with_stages(m, stages, chunk))
        reference = out if reference is None else reference
        print(f"   max diff from registers: {(out.float() - reference.float()).abs().max():.3g}"
              f" (|h| max {reference.float().abs().max():.3g})", flush=True)
for name, (stages, chunk) in VARIANTS.items():
    run(name, MOE, with_stages(traced, stages, chunk))
