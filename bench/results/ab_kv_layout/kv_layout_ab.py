"""A/B of the KV cache layout for decode attention: [blocks, page, heads, dim] (NHD, main)
against [blocks, heads, page, dim] (HND, passed to the same kernel as a transposed view),
at offline-like batches; beside the device's plain read rate."""
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_attention import graph_us  # noqa: E402

from bcg.kernels.decode_attention import DecodeConfig, decode_attention, plan_decode  # noqa: E402

DIM = 128
DT = torch.bfloat16


@triton.jit
def _read_kernel(x_ptr, out_ptr, n_per_prog, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * n_per_prog
    acc = tl.zeros([BLOCK], tl.float32)
    for off in range(0, n_per_prog, BLOCK):
        acc += tl.load(x_ptr + base + off + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


def read_rate(nbytes: int) -> None:
    x = torch.randn(nbytes // 2, dtype=DT, device="cuda")
    for progs, block, warps in ((132 * 4, 4096, 8), (132 * 8, 2048, 4), (132 * 16, 2048, 4)):
        out = torch.empty(progs, device="cuda")
        n = x.numel() // progs // block * block
        fn = lambda: _read_kernel[(progs,)](x, out, n, BLOCK=block, num_warps=warps)  # noqa
        us = graph_us([fn] * 4)
        print(f"read kernel progs {progs} block {block} warps {warps}: "
              f"{progs * n * 2 / us / 1e3:.0f} GB/s", flush=True)
    us = graph_us([lambda: x.sum(dtype=torch.float32)] * 4)
    print(f"torch.sum: {nbytes / us / 1e3:.0f} GB/s", flush=True)
    y = torch.empty_like(x)
    us = graph_us([lambda: y.copy_(x)] * 4)
    print(f"copy (read+write): {2 * nbytes / us / 1e3:.0f} GB/s", flush=True)


def make_cache(layout: str, num_blocks: int, page: int, kv_heads: int):
    if layout == "nhd":
        shape = (num_blocks, page, kv_heads, DIM)
        k, v = (torch.randn(shape, dtype=DT, device="cuda") for _ in range(2))
        return k, v
    shape = (num_blocks, kv_heads, page, DIM)
    k, v = (torch.randn(shape, dtype=DT, device="cuda") for _ in range(2))
    return k.transpose(1, 2), v.transpose(1, 2)


def case(heads: int, kv_heads: int, batch: int, lo: int, hi: int, layouts, configs) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    seq_lens = torch.randint(lo, hi + 1, (batch,), device="cuda", generator=gen,
                             dtype=torch.int32)
    seq_lens = seq_lens.sort(descending=True).values
    total = int(seq_lens.sum())
    kv_bytes = total * kv_heads * DIM * 2 * 2
    q = torch.randn(batch, heads, DIM, dtype=DT, device="cuda")
    print(f"\n== heads {heads}/{kv_heads} batch {batch} lengths {lo}-{hi}: "
          f"{kv_bytes / 1e9:.2f} GB a call", flush=True)
    for layout, page in layouts:
        ref = None
        max_blocks = triton.cdiv(hi, page)
        num_blocks = batch * max_blocks
        k, v = make_cache(layout, num_blocks, page, kv_heads)
        tables = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
        tables = tables.view(batch, max_blocks)
        out = torch.empty_like(q)
        for cfg in configs:
            plan = plan_decode(batch, heads, kv_heads, DIM, "cuda", config=cfg)
            fn = lambda: decode_attention(q, k, v, seq_lens, tables, DIM**-0.5, out=out,  # noqa
                                          plan=plan)
            try:
                us = graph_us([fn] * 4)
            except Exception as error:  # noqa: BLE001
                print(f"{layout} page {page} cfg {cfg}: {type(error).__name__}", flush=True)
                continue
            if ref is None:
                ref = out.clone()
            err = (out.float() - ref.float()).abs().max().item()
            print(f"{layout} page {page:3d} cfg {cfg.block_n}/{cfg.num_warps}/{cfg.num_stages}"
                  f" splits {plan.num_splits}: {us:8.1f} us  {kv_bytes / us / 1e3:6.0f} GB/s  err {err:.3g}",
                  flush=True)
        del k, v
        torch.cuda.empty_cache()


def main() -> None:
    print(torch.cuda.get_device_name(), flush=True)
    read_rate(2**30)
    configs = [DecodeConfig(*c) for c in ((64, 4, 2), (128, 4, 2), (128, 4, 3), (128, 8, 2),
                                           (128, 8, 3), (256, 8, 2))]
    layouts = [("nhd", 16), ("hnd", 16), ("hnd", 64)]
    for heads in (32, 16):
        case(heads, 8, 256, 100, 2048, layouts, configs)
        case(heads, 8, 96, 600, 2048, layouts, configs)
    small = [DecodeConfig(64, 4, 2), DecodeConfig(64, 4, 3), DecodeConfig(128, 4, 2)]
    case(32, 8, 1, 4096, 4096, layouts, small)
    case(32, 8, 8, 2048, 2048, layouts, small)


if __name__ == "__main__":
    main()
