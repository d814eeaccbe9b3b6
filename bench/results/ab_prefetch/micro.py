"""Does an L2 prefetch issued during a wait make the next skinny projection faster?
CUDA graph of 8 (wait kernel, skinny projection) pairs over distinct weights; the wait
kernel spins SPIN ns on the global timer and, with a prefetch, first asks L2 for the head
of the weight the projection after it reads. Prints µs per pair minus a wait-only graph."""
import torch
import triton
import triton.language as tl

import bcg.kernels.skinny_linear as sk
from bcg.utils import cdiv


@triton.jit
def _prefetch_share(base_ptr, TOTAL: tl.constexpr, SHARE: tl.constexpr, LINES: tl.constexpr,
                    PIECE: tl.constexpr, MODE: tl.constexpr):
    """Ask L2 for this program's share of `TOTAL` bytes from `base_ptr`, fire and forget:
    MODE 1 `prefetch.global.L2` a line a lane, 2 the same with `evict_last`, 3
    `cp.async.bulk.prefetch.L2` a piece a lane (the helper the tail-prefetch branch had)."""
    offsets = tl.program_id(0) * SHARE + tl.arange(0, LINES) * PIECE
    offsets = tl.minimum(offsets, TOTAL - PIECE)  # the last shares repeat the last piece
    mask = tl.arange(0, LINES) * PIECE < SHARE
    offsets = tl.where(mask, offsets, TOTAL - PIECE)
    if MODE == 1:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l",
                                  [base_ptr + offsets], dtype=tl.int32, is_pure=False, pack=1)
    elif MODE == 2:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n mov.u32 $0, 0;",
                                  "=r,l", [base_ptr + offsets], dtype=tl.int32, is_pure=False,
                                  pack=1)
    else:
        sizes = tl.full((LINES,), PIECE, tl.int32)
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n mov.u32 $0, 0;",
                                  "=r,l,r", [base_ptr + offsets, sizes], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _now(dummy):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dummy],
                                      dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def wait_kernel(p_ptr, SPIN: tl.constexpr, TOTAL: tl.constexpr, SHARE: tl.constexpr,
                LINES: tl.constexpr, PIECE: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0)
    start = _now(pid)
    if TOTAL > 0:
        _prefetch_share(p_ptr, TOTAL, SHARE, LINES, PIECE, MODE)
    if pid == 0:
        now = _now(pid)
        while now - start < SPIN:
            now = _now(pid)


def wait(p, spin, total, mode, programs=8):
    share = cdiv(cdiv(total, programs), 128) * 128 if total else 128
    if mode == 3:
        lines = 128
        piece = cdiv(cdiv(share, lines), 16) * 16
    else:
        lines, piece = triton.next_power_of_2(max(1, share // 128)), 128
    wait_kernel[(programs,)](p, SPIN=spin, TOTAL=total, SHARE=share, LINES=lines, PIECE=piece,
                             MODE=mode, num_warps=4)


def graph_us(fn, reps=50):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return sorted(times)[2]


def main():
    torch.manual_seed(0)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    shapes = {"qkv tp2 (3072x4096)": (3072, 4096, False), "o tp2 (4096x2048)": (4096, 2048, False),
              "gate_up tp2 (12288x4096)": (12288, 4096, True),
              "down tp2 (4096x6144)": (4096, 6144, False),
              "qkv tp1 (6144x4096)": (6144, 4096, False)}
    for spin in (3000, 8000):
        for label, (n, k, gated) in shapes.items():
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
            xs = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            flat = [w.reshape(-1).view(torch.uint8) for w in ws]
            base_wait = graph_us(lambda: [wait(flat[0], spin, 0, 1) for _ in range(8)]) / 8
            row = []
            for total_mb, mode in ((0, 1), (4, 1), (8, 1), (16, 1), (8, 2), (16, 2), (8, 3), (16, 3)):
                total = min(total_mb << 20, flat[0].numel())

                def pairs():
                    for i in range(8):
                        wait(flat[i], spin, total, mode)
                        sk.skinny_linear(xs, ws[i], gated=gated)
                row.append(f"{total_mb}MB/m{mode} {graph_us(pairs) / 8 - base_wait:6.2f}")
            print(f"spin {spin / 1000:.0f}us wait {base_wait:5.2f} | {label}: " + " | ".join(row),
                  flush=True)
            del ws, flat


if __name__ == "__main__":
    main()
