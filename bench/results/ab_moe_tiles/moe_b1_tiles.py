"""Each grouped GEMM of a 1- and 2-token MoE step (Qwen3-30B-A3B experts) alone, per tile
config, in CUDA graphs: where the 39 us of the fused MoE at one token go."""
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import time_per_call_ms  # noqa: E402

from bcg.kernels.fused_moe import (  # noqa: E402
    DECODE_TILES, MoETiles, _grouped_gemm, _sum_choices, align_to_experts, fused_experts)
from bcg.layers.fused_moe import select_experts  # noqa: E402

E, TOPK, H, I = 128, 8, 2048, 768
DT = torch.bfloat16
ROUTINGS = 8


def graph_us(calls) -> float:
    graphs = []
    for call in calls:
        call()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(4):
                call()
        graphs.append(g)

    def replay():
        for g in graphs:
            g.replay()
    return time_per_call_ms(replay, iters=30) * 1e3 / (4 * len(graphs))


def main() -> None:
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), flush=True)
    gate_up = torch.randn(E, 2 * I, H, dtype=DT, device="cuda") * H**-0.5
    down = torch.randn(E, H, I, dtype=DT, device="cuda") * I**-0.5
    for tokens in (1, 2):
        x = torch.randn(tokens, H, dtype=DT, device="cuda")
        routings = []
        for _ in range(ROUTINGS):
            w, ids = select_experts(torch.randn(tokens, E, device="cuda"), TOPK, True)
            routings.append((w.float().contiguous(), ids))
        base = DECODE_TILES.for_device(True)
        total = graph_us([lambda w=w, i=i: fused_experts(x, gate_up, down, w, i)
                          for w, i in routings])
        nbytes = tokens * TOPK * 3 * H * I * 2  # upper bound (distinct experts)
        print(f"\n== {tokens} token(s): fused_experts {total:.1f} us "
              f"({nbytes / total / 1e3:.0f} GB/s at most)", flush=True)
        act = torch.empty(tokens * TOPK, I, dtype=DT, device="cuda")
        out = torch.empty(tokens * TOPK, H, dtype=DT, device="cuda")
        aligns = [(w, align_to_experts(i, E, base.block_m)) for w, i in routings]
        us = graph_us([lambda o=out: _sum_choices(o.view(tokens, TOPK, H))])
        print(f"sum_choices {us:.1f} us", flush=True)
        grid = itertools.product([16, 32, 64], [128, 256], [2, 4], [3, 4, 6])
        rows = []
        for bn, bk, warps, stages in grid:
            tiles = MoETiles(16, bn, bk, 1, warps, stages, fuse_activation=True)
            try:
                g1 = graph_us([lambda w=w, a=a: _grouped_gemm(
                    x, gate_up, act, w, a, tiles, rows_per_input=TOPK, scale_by_weight=False,
                    gated=True) for w, a in aligns])
                g2 = graph_us([lambda w=w, a=a: _grouped_gemm(
                    act, down, out, w, a, tiles, rows_per_input=1, scale_by_weight=True)
                    for w, a in aligns])
            except Exception as error:  # noqa: BLE001
                print(f"{bn}/{bk}/{warps}/{stages}: {type(error).__name__}", flush=True)
                continue
            rows.append((g1, g2, (bn, bk, warps, stages)))
        mark = (base.block_n, base.block_k, base.num_warps, base.num_stages)
        print("default", mark, [r[:2] for r in rows if r[2] == mark], flush=True)
        print("gate_up best:", flush=True)
        for g1, _, cfg in sorted(rows)[:6]:
            print(f"  {cfg}: {g1:.1f} us", flush=True)
        print("down best:", flush=True)
        for _, g2, cfg in sorted(rows, key=lambda r: r[1])[:6]:
            print(f"  {cfg}: {g2:.1f} us", flush=True)


if __name__ == "__main__":
    main()
