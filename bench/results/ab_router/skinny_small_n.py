"""Decode-sized linears the skinny kernel leaves to cuBLAS today (too few column tiles):
the MoE router (128 x 2048) and qwen3-30b-a3b's o projection (2048 x 4096); skinny at
narrower column tiles against cuBLAS (+ the route kernel for the router), in CUDA graphs."""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import time_per_call_ms  # noqa: E402

from bcg.kernels.moe_routing import route_top_k  # noqa: E402
from bcg.kernels.skinny_linear import SkinnyConfig, skinny_linear  # noqa: E402

DT = torch.bfloat16
SETS = 16  # weight copies rotated through, past the L2


def graph_us(calls) -> float:
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(4):
            for c in calls:
                c()
    return time_per_call_ms(g.replay, iters=50) * 1e3 / (4 * len(calls))


def main() -> None:
    print(torch.cuda.get_device_name(), flush=True)
    shapes = {"router 128x2048": (128, 2048), "30b o 2048x4096": (2048, 4096),
              "235b router 128x4096": (128, 4096), "235b-tp8 o 4096x1024": (4096, 1024)}
    configs = [SkinnyConfig(*c) for c in ((16, 256, 4, 4), (16, 128, 4, 4), (16, 256, 2, 4),
                                          (16, 512, 4, 3), (32, 256, 4, 4), (16, 256, 8, 4))]
    for name, (n, k) in shapes.items():
        ws = [torch.randn(n, k, dtype=DT, device="cuda") * k**-0.5 for _ in range(SETS)]
        for rows in (1, 8, 16):
            x = torch.randn(rows, k, dtype=DT, device="cuda")
            cub = graph_us([lambda w=w: F.linear(x, w) for w in ws])
            line = f"{name} rows {rows}: cuBLAS {cub:.2f}"
            if n == 128:
                both = graph_us([lambda w=w: route_top_k(F.linear(x, w), 8, True) for w in ws])
                line += f" (+route {both:.2f})"
            for cfg in configs:
                try:
                    us = graph_us([lambda w=w: skinny_linear(x, w, config=cfg) for w in ws])
                except Exception as error:  # noqa: BLE001
                    line += f" | {cfg.block_n}/{cfg.block_k}/{cfg.num_warps}/{cfg.num_stages} "
                    line += type(error).__name__
                    continue
                err = (skinny_linear(x, ws[0], config=cfg).float()
                       - F.linear(x, ws[0]).float()).abs().max().item()
                line += (f" | {cfg.block_n}/{cfg.block_k}/{cfg.num_warps}/{cfg.num_stages} "
                         f"{us:.2f} (err {err:.2g})")
            print(line, flush=True)


if __name__ == "__main__":
    main()
