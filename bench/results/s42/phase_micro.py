"""One projection phase of the fused decode stack alone: 132 programs of 8 warps (one a
multiprocessor, as in the stack), each streaming its column tile of a weight, one launch a
call, in CUDA graphs cycling weight copies past the L2 (as bench_skinny_linear times it).
qwen3-30b-a3b's QKV (5120 x 2048, tiles of 40), o (2048 x 4096, tiles of 16), the 8 chosen
experts' gate/up (tiles of 48 gated columns in one expert) and down (16 columns x the 8
experts' 768); weight chunks in registers (`_project`, STAGES 0) or pipelined through shared
memory (STAGES > 0) at several chunk widths; cuBLAS and the skinny kernel beside them. Then
the top-k alone (`_routed`, 132 programs of 8 warps), to time it.
python bench/results/s42/phase_micro.py   (CPU: TRITON_INTERPRET=1, small shapes, checks only)"""
import functools
import sys

import torch

sys.path.insert(0, ".")
import bcg.kernels  # noqa: E402,F401  (the interpreter first, off GPU)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bcg.kernels._launch import next_power_of_2  # noqa: E402
from bcg.kernels.decode_stack import (  # noqa: E402
    _experts_chunk,
    _project,
    _project_experts,
    _project_experts_piped,
    _routed,
    _tile_rows,
    _weight_chunk,
)
from bcg.kernels.moe_routing import _store_top_k  # noqa: E402
from bcg.kernels.skinny_linear import skinny_linear  # noqa: E402

GPU = torch.cuda.is_available()
dev = torch.device("cuda" if GPU else "cpu")
DTYPE = torch.bfloat16 if GPU else torch.float32
PROGRAMS = 132 if GPU else 4
CALLS = 24


@triton.jit
def _phase_kernel(w_ptr, x_ptr, norm_ptr, out_ptr, inv_rms, N: tl.constexpr, K: tl.constexpr,
                  TILE: tl.constexpr, TILE_P2: tl.constexpr, CHUNK: tl.constexpr,
                  STAGES: tl.constexpr, GATED: tl.constexpr, HALF: tl.constexpr):
    pid = tl.program_id(0)
    rows = _tile_rows(pid, TILE, TILE_P2, GATED, HALF)
    valid = pid * TILE < N
    first = _weight_chunk(w_ptr, rows, 0, valid, K, CHUNK)
    acc = _project(first, w_ptr, rows, valid, x_ptr, norm_ptr, inv_rms, K, CHUNK, True, STAGES)
    tl.store(out_ptr + rows, acc, mask=valid & (rows >= 0))


@triton.jit
def _experts_kernel(w_ptr, ids_ptr, x_ptr, out_ptr, OUT: tl.constexpr, K: tl.constexpr,
                    TILE: tl.constexpr, TILE_P2: tl.constexpr, CHUNK: tl.constexpr,
                    TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    rows = _tile_rows(pid, TILE, TILE_P2, False, 0)
    valid = pid * TILE < OUT
    slots = tl.arange(0, TOP_K_P2)
    chosen = slots < TOP_K
    if STAGES > 0:
        acc = _project_experts_piped(w_ptr, ids_ptr, rows, valid, x_ptr, K, OUT * K, CHUNK,
                                     TOP_K, STAGES)
        total = tl.sum(acc, 0)
    else:
        offsets = tl.load(ids_ptr + slots, mask=chosen, other=0).to(tl.int64) * (OUT * K)
        first = _experts_chunk(w_ptr, offsets, rows, 0, valid, chosen, K, CHUNK)
        total = tl.sum(_project_experts(first, w_ptr, offsets, rows, valid, chosen, x_ptr, K,
                                        CHUNK), 1)
    tl.store(out_ptr + rows, total, mask=valid & (rows >= 0))


@triton.jit
def _top_k_kernel(logits_ptr, out_ptr, NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr,
                  EXPERTS_P2: tl.constexpr, TOP_K_P2: tl.constexpr):
    ids, weights = _routed(logits_ptr, NUM_EXPERTS, TOP_K, True, EXPERTS_P2, TOP_K_P2)
    slots = tl.arange(0, TOP_K_P2)
    tl.store(out_ptr + tl.program_id(0) * TOP_K_P2 + slots, ids.to(tl.float32) + weights)


@triton.jit
def _picks_kernel(logits_ptr, out_ptr, NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr,
                  EXPERTS_P2: tl.constexpr, TOP_K_P2: tl.constexpr):
    """The routing kernel's top-k (a pick at a time), for comparison."""
    experts = tl.arange(0, EXPERTS_P2)
    logits = tl.load(logits_ptr + experts, mask=experts < NUM_EXPERTS, other=float("-inf"),
                     cache_modifier=".cg")
    base = out_ptr + tl.program_id(0) * 2 * TOP_K_P2
    _store_top_k(logits, base, (base + TOP_K_P2).to(tl.pointer_type(tl.int32)), NUM_EXPERTS,
                 TOP_K, True, EXPERTS_P2, TOP_K_P2)


def graph_us(calls):
    for call in calls[:2]:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); graph.replay(); b.record(); torch.cuda.synchronize()  # noqa: E702
        best = min(best, a.elapsed_time(b) * 1000 / len(calls))
    return best


def copies(*shape):
    count = max(1, -(-100 * 2**20 // (torch.Size(shape).numel() * 2))) if GPU else 1
    return [torch.randn(*shape, device=dev, dtype=DTYPE) * 0.02 for _ in range(count)]


def report(name, bytes_read, us, check=None):
    rate = bytes_read / us / 1e3
    print(f"{name:44s} {us:8.2f} us  {rate:7.0f} GB/s  {check or ''}", flush=True)


def phase(name, n, k, tile, gated, variants):
    weights = copies(2 * n if gated else n, k)
    x = torch.randn(k, device=dev, dtype=DTYPE)
    norm = torch.ones(k, device=dev, dtype=DTYPE)
    out = torch.empty(2 * n if gated else n, device=dev, dtype=torch.float32)
    expected = (weights[0].float() @ x.float())
    bytes_read = weights[0].numel() * weights[0].element_size()
    for stages, chunk in variants:
        launch = functools.partial(_phase_kernel[(PROGRAMS,)], x_ptr=x, norm_ptr=norm,
                                   out_ptr=out, inv_rms=1.0, N=n, K=k, TILE=tile,
                                   TILE_P2=next_power_of_2(tile), CHUNK=chunk, STAGES=stages,
                                   GATED=gated, HALF=n, num_warps=8, num_stages=1)
        try:
            launch(weights[0])
            error = ((out - expected).norm() / expected.norm()).item()
            us = graph_us([functools.partial(launch, w) for w in weights] * (CALLS // len(weights) + 1)) \
                if GPU else float("nan")
            report(f"{name} stages {stages} chunk {chunk}", bytes_read, us, f"err {error:.1e}")
        except Exception as e:  # noqa: BLE001  (out of shared memory: skip)
            print(f"{name} stages {stages} chunk {chunk}: {type(e).__name__} {str(e)[:100]}")
    if GPU and not gated:
        xs = x[None]
        report(f"{name} cuBLAS", bytes_read, graph_us(
            [functools.partial(torch.nn.functional.linear, xs, w) for w in weights] * 4))
        report(f"{name} skinny", bytes_read, graph_us(
            [functools.partial(skinny_linear, xs, w) for w in weights] * 4))


def experts(variants):
    num_experts, out_n, k, top_k = (128, 2048, 768, 8) if GPU else (6, 32, 64, 3)
    tile = 16 if GPU else 8
    weights = copies(num_experts, out_n, k)[:1]
    # the chosen experts (25 MB) change every call: 8 sets are 200 MB, past the L2
    id_sets = [torch.randperm(num_experts, device=dev)[:top_k].to(torch.int32)
               for _ in range(8)]
    ids = id_sets[0]
    x = torch.randn(top_k, k, device=dev, dtype=DTYPE)
    out = torch.empty(out_n, device=dev, dtype=torch.float32)
    expected = sum(weights[0][e].float() @ x[s].float() for s, e in enumerate(ids.tolist()))
    bytes_read = top_k * out_n * k * 2
    for stages, chunk in variants:
        launch = functools.partial(_experts_kernel[(PROGRAMS,)], weights[0], x_ptr=x,
                                   out_ptr=out, OUT=out_n, K=k, TILE=tile, TILE_P2=tile,
                                   CHUNK=chunk, TOP_K=top_k, TOP_K_P2=next_power_of_2(top_k),
                                   STAGES=stages, num_warps=8, num_stages=1)
        try:
            launch(ids_ptr=ids)
            error = ((out - expected).norm() / expected.norm()).item()
            us = graph_us([functools.partial(launch, ids_ptr=i) for i in id_sets] * 3) \
                if GPU else float("nan")
            report(f"down of 8 experts stages {stages} chunk {chunk}", bytes_read, us,
                   f"err {error:.1e}")
        except Exception as e:  # noqa: BLE001
            print(f"down stages {stages} chunk {chunk}: {type(e).__name__} {str(e)[:100]}")


def top_k():
    experts_n = 128
    logits = torch.randn(experts_n, device=dev)
    out = torch.empty(PROGRAMS * 8, device=dev)
    launch = functools.partial(_top_k_kernel[(PROGRAMS,)], logits, out, experts_n, 8, 128, 8,
                               num_warps=8, num_stages=1)
    launch()
    picks = functools.partial(_picks_kernel[(PROGRAMS,)], logits, out, experts_n, 8, 128, 8,
                              num_warps=8, num_stages=1)
    picks()
    if GPU:
        print(f"top-k alone (132 programs of 8 warps): {graph_us([launch] * CALLS):.2f} us;"
              f" a pick at a time: {graph_us([picks] * CALLS):.2f} us; 1 warp: "
              f"{graph_us([functools.partial(picks, num_warps=1)] * CALLS):.2f} us")


if GPU:
    phase("qkv 5120x2048 tile 40", 5120, 2048, 40, False,
          [(0, 128), (3, 128), (3, 256), (4, 256), (3, 512), (2, 1024)])
    phase("o 2048x4096 tile 16", 2048, 4096, 16, False,
          [(0, 1024), (0, 512), (3, 512), (4, 512), (3, 1024), (6, 256)])
    phase("gate/up 8x1536x2048 tile 48", 6144, 2048, 48, True,
          [(0, 128), (3, 128), (4, 128), (3, 256), (2, 512)])
    experts([(0, 64), (3, 256), (4, 256), (6, 256), (4, 128), (3, 768)])
    top_k()
else:
    phase("qkv", 40, 64, 10, False, [(0, 16), (2, 16), (3, 32)])
    phase("gate/up", 24, 64, 6, True, [(0, 16), (3, 16)])
    experts([(0, 16), (2, 16), (3, 32)])
    top_k()
