"""The one-launch router (GEMM + top-k) against cuBLAS's GEMM then the route kernel, in CUDA
graphs, per program shape."""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from skinny_small_n import graph_us  # noqa: E402

from bcg.kernels import moe_routing as mr  # noqa: E402
from bcg.kernels._launch import next_power_of_2  # noqa: E402
from bcg.utils import cdiv  # noqa: E402

DT = torch.bfloat16
SETS = 16


def fused(x, w, arrivals, per_program, block_h, warps):
    t, h = x.shape
    e = w.shape[0]
    weights = torch.empty(t, 8, dtype=torch.float32, device="cuda")
    ids = torch.empty(t, 8, dtype=torch.int32, device="cuda")
    logits = torch.empty(t, e, dtype=torch.float32, device="cuda")
    mr._launch_router_route(
        (t, cdiv(e, per_program)), (x, w, logits, arrivals, weights, ids), (),
        {"HIDDEN": h, "NUM_EXPERTS": e, "TOP_K": 8, "RENORMALIZE": True, "STRIDE_X": h,
         "STRIDE_W": h, "EXPERTS_PER_PROGRAM": per_program, "BLOCK_HIDDEN": block_h,
         "BLOCK_E": next_power_of_2(e), "BLOCK_K": 8}, num_warps=warps)
    return weights, ids


def main() -> None:
    print(torch.cuda.get_device_name(), flush=True)
    arrivals = torch.zeros(16, dtype=torch.int32, device="cuda")
    for e, h in ((128, 2048), (128, 4096)):
        ws = [torch.randn(e, h, dtype=DT, device="cuda") * h**-0.5 for _ in range(SETS)]
        for t in (1, 8, 16):
            x = torch.randn(t, h, dtype=DT, device="cuda")
            base = graph_us([lambda w=w: mr.route_top_k(F.linear(x, w), 8, True) for w in ws])
            default = graph_us([lambda w=w: mr.route_hidden_top_k(x, w, 8, True, arrivals)
                                for w in ws])
            ref_w, ref_i = mr.route_top_k(F.linear(x, ws[0]), 8, True)
            got_w, got_i = mr.route_hidden_top_k(x, ws[0], 8, True, arrivals)
            same = bool((ref_i == got_i).all())
            line = (f"{e}x{h} tokens {t}: cuBLAS+route {base:.2f} | fused default {default:.2f}"
                    f" (ids same {same}, arrivals {int(arrivals.abs().sum())})")
            for per_program, block_h, warps in ((2, 512, 1), (2, 1024, 1), (4, 1024, 1),
                                                (4, 512, 2), (4, 512, 1), (1, 1024, 1)):
                us = graph_us([lambda w=w: fused(x, w, arrivals, per_program, block_h, warps)
                               for w in ws])
                line += f" | {per_program}/{block_h}/{warps} {us:.2f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
