"""The fused decode stack alone on qwen3-0.6b's shapes (28 layers, random weights, one
sequence of CONTEXT tokens), in a CUDA graph of REPEAT launches: µs a launch for variants of
its tiling (chunk elements, warps) and one with the grid barriers taken out (a lower bound,
its results wrong; run it alone: Triton's in-process cache would not see the change).
python bench/results/s40/stack_micro.py [variant ...]"""
import sys, torch, triton, triton.language as tl
sys.path.insert(0, ".")
import bcg.kernels.decode_stack as m
from bcg.kernels.decode_stack import StackShape, decode_stack, make_workspace

CONTEXT, REPEAT = 256, 20
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
blocks = 64
storage = torch.randn(2, L, blocks, 16, 8, 128, device=dev, dtype=torch.bfloat16)
cos = torch.randn(4096, 64, device=dev); sin = torch.randn(4096, 64, device=dev)
positions = torch.tensor([CONTEXT - 1], device=dev)
slots = torch.tensor([CONTEXT - 1], device=dev)
seq_lens = torch.tensor([CONTEXT], device=dev, dtype=torch.int32)
block_tables = torch.arange(blocks, device=dev, dtype=torch.int32)[None]
hidden = torch.randn(1, 1024, device=dev, dtype=torch.bfloat16)


@triton.jit
def _no_wait(barrier_ptr, target):
    tl.debug_barrier()


def time_variant(name, chunk, warps, no_barrier=False):
    """(The L2 asks, load polls and two chunks in flight of calls b and c were flags of the
    kernel then, removed after these runs.)"""
    m.CHUNK_ELEMENTS, m.NUM_WARPS = chunk, warps
    m._launch = m.CachedLauncher(m._decode_stack_kernel)
    if no_barrier:
        m._decode_stack_kernel.fn.__globals__["_wait_for_all"] = _no_wait
    ws = make_workspace(shape, torch.bfloat16, dev)
    run = lambda: decode_stack(hidden, positions, slots, seq_lens, block_tables, table, storage,
                               cos, sin, ws, shape, 1e-6)
    run(); torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEAT):
            run()
    graph.replay(); torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); graph.replay(); b.record(); torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / REPEAT)
    k = next(iter(m._launch.compiled.values()))
    print(f"{name:28s} {min(times):8.1f} us/launch  {min(times)/L:6.2f} us/layer  regs {k.n_regs} "
          f"spills {k.n_spills}", flush=True)


# Weights alone: the bytes a launch reads, copied once by the device (a rate, not a kernel).
nbytes = sum(w.numel() * 2 for row in W for w in row[:4])
buf = torch.empty(nbytes // 2, device=dev, dtype=torch.bfloat16)
src = torch.cat([w.flatten() for row in W for w in row[:4]])
for _ in range(3): buf.copy_(src)
a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
a.record(); buf.copy_(src); b.record(); torch.cuda.synchronize()
print(f"weights {nbytes/1e6:.1f} MB; a device copy of them (read + write) {a.elapsed_time(b)*1000:.1f} us")
variants = {"chunk 8k x8": (8192, 8), "chunk 16k x8": (16384, 8)}
wanted = sys.argv[1:] or list(variants)
for name in wanted:
    if name == "no barrier":
        time_variant(name, 8192, 8, no_barrier=True)
    else:
        time_variant(name, *variants[name])
