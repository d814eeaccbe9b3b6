"""The fused decode stack alone on qwen3-0.6b's shapes (28 layers, random weights, one
sequence of CONTEXT tokens), in a CUDA graph of REPEAT launches: µs a launch of main's kernel
and of variants, each result against main's. Before a call, the kernels it imports were
written beside it: decode_stack_main.py (`git show 25fa87a:bcg/kernels/decode_stack.py`) and
decode_stack_tiling.py (the tree with only the 24-column gate/up tiles). This is call g's
version; calls a-f timed experiment flags of the kernel since removed (their logs: callA-F).
python bench/results/s41/stack_micro.py [CONTEXT]"""
import sys, torch
sys.path.insert(0, ".")
import bcg.kernels.decode_stack as m
from bcg.kernels.decode_stack import StackShape

CONTEXT = int(sys.argv[1]) if len(sys.argv) > 1 else 256
REPEAT = 20
shape = StackShape(28, 1024, 16, 8, 128, 3072, True)
dev = torch.device("cuda")
torch.manual_seed(0)
L = shape.num_layers
W = [[torch.randn(shape.qkv_size, 1024, device=dev, dtype=torch.bfloat16) * 0.02,
      torch.randn(1024, 2048, device=dev, dtype=torch.bfloat16) * 0.02,
      torch.randn(6144, 1024, device=dev, dtype=torch.bfloat16) * 0.02,
      torch.randn(1024, 3072, device=dev, dtype=torch.bfloat16) * 0.02]
     + [torch.ones(n, device=dev, dtype=torch.bfloat16) for n in (1024, 1024, 128, 128)]
     for _ in range(L)]
table = torch.tensor([[w.data_ptr() for w in row] for row in W], dtype=torch.int64, device=dev)
blocks = 8192 // 16
storage = torch.randn(2, L, blocks, 16, 8, 128, device=dev, dtype=torch.bfloat16)
cos = torch.randn(8192, 64, device=dev); sin = torch.randn(8192, 64, device=dev)
positions = torch.tensor([CONTEXT - 1], device=dev)
slots = torch.tensor([CONTEXT - 1], device=dev)
seq_lens = torch.tensor([CONTEXT], device=dev, dtype=torch.int32)
block_tables = torch.arange(blocks, device=dev, dtype=torch.int32)[None]
hidden0 = torch.randn(1, 1024, device=dev, dtype=torch.bfloat16)


def time_variant(name, module, reference):
    ws = module.make_workspace(shape, torch.bfloat16, dev)
    hidden = hidden0.clone()
    run = lambda: module.decode_stack(hidden, positions, slots, seq_lens, block_tables, table,
                                      storage, cos, sin, ws, shape, 1e-6)
    run(); torch.cuda.synchronize()
    out = hidden.clone()
    same = "" if reference is None else \
        f"max diff from main {(out.float() - reference.float()).abs().max().item():.3g}" \
        f" (|h| max {reference.float().abs().max().item():.3g})"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEAT):
            run()
    graph.replay(); torch.cuda.synchronize()
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); graph.replay(); b.record(); torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / REPEAT)
    k = next(iter(module._launch.compiled.values()))
    print(f"ctx {CONTEXT:5d} {name:34s} {min(times):8.1f} us/launch  {min(times)/L:6.2f} us/layer"
          f"  regs {k.n_regs} spills {k.n_spills}  {same}", flush=True)
    return out


sys.path.insert(0, "bench/results/s41")
import decode_stack_main as main_module
import decode_stack_tiling as tiling_module


def with_chunks(**chunks):
    m.CHUNK_ELEMENTS = {**{"qkv": 8192, "o": 8192, "gate_up": 16384, "down": 8192}, **chunks}
    m._constexprs.cache_clear()
    m._launch = m.CachedLauncher(m._decode_stack_kernel)
    return m


reference = None
for _ in range(2):
    out = time_variant("main", main_module, None)
    reference = out if reference is None else reference
    time_variant("24-col gate/up, 16k chunks", tiling_module, reference)
    time_variant("+ norms early, k beside q", with_chunks(), reference)
    time_variant("+ qkv 16k chunks", with_chunks(qkv=16384), reference)
    time_variant("+ o 16k chunks", with_chunks(o=16384), reference)
