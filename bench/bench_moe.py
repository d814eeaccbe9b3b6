"""Qwen3-MoE on dummy qwen3-30b-a3b, bf16: one GPU, tensor parallel and expert parallel.

Configurations: `tp1` (one GPU); on two GPUs `tp2` (each expert's intermediate dimension
split; decode-sized all-reduces through the custom all-reduce, the default), `ep2-allreduce`
(half the experts per rank, one all-reduce) and `ep2-alltoall` (each token sent to its
experts' ranks); on request `tp2-nccl` (tp2 with `--disable-custom-all-reduce`) and
`tp2-symm-mem` (tp2 with
`--enable-torch-symm-mem`), decode and offline, and `ep2-alltoall-blocks` (ep2-alltoall with
every step of this bench, up to 4096 tokens, exchanged in fixed-size blocks, to compare with
the default's counted rows above 2048 tokens).
Rows, each measured as `bench/model_suite.py` describes: prefill (eager, breakable,
piecewise), decode engine step at batch 1, 8 and 64, bench_offline's output tok/s. Decode
rows carry two weight-read floors per rank: `floor` (every weight, all experts) and
`moe_floor`, the weights a one-token step reads: attention, router and dense weights, and
the top-8 of the 128 experts of each layer (under expert parallel the rank's expected
share, 8 x its experts / 128, as if routing were even). Targets (the MoE issue): breakable
≤ piecewise on every prefill row; at decode batch 1, moe_floor_ms / ms per step ≥ 0.70
(the step includes the host's work, the head and sampling, so this bounds the MoE layers'
share from below). JSON: bench/results/bench_moe.json.
Run: python bench/bench_moe.py [--configs tp1 | tp2 ep2-allreduce ep2-alltoall
tp2-symm-mem ep2-alltoall-blocks]
[--parts prefill decode offline] [--offline-requests N]. Default: tp1 with one GPU, the
three two-GPU configurations with two or more; each configuration or part can run alone
(the JSON keeps the others' earlier rows).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_suite as suite  # noqa: E402
from common import decode_weight_bytes  # noqa: E402

from bcg.models.qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402

MODEL = "qwen3-30b-a3b"
EXPERT_PARALLEL = {"model": MODEL, "tensor_parallel_size": 2, "enable_expert_parallel": True}
SETUPS = {
    "tp1": suite.Setup({"model": MODEL}),
    **suite.tensor_parallel_setups(MODEL),  # tp2-nccl and tp2-symm-mem on request
    "ep2-allreduce": suite.Setup({**EXPERT_PARALLEL, "ep_dispatch": "allreduce"}),
    "ep2-alltoall": suite.Setup({**EXPERT_PARALLEL, "ep_dispatch": "alltoall"}),
    "ep2-alltoall-blocks": suite.Setup({**EXPERT_PARALLEL, "ep_dispatch": "alltoall",
                                        "ep_fixed_block_tokens": 4096}),
}


def active_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a one-token forward reads on this rank: `decode_weight_bytes` with
    each sparse layer's experts counted at top_k / num_experts of the rank's experts (all of
    them routed to under tensor parallel; the even share under expert parallel)."""
    unread = 0
    for block in model.modules():
        if isinstance(block, Qwen3MoeSparseMoeBlock):
            experts = block.experts
            local = sum(p.numel() * p.element_size()
                        for p in (experts.gate_up_proj, experts.down_proj))
            unread += local - local * block.top_k // experts.num_experts
    return decode_weight_bytes(model) - unread


def report(rows: list[dict]) -> None:
    suite.print_tables(rows, "moe_floor")
    for config in SETUPS:
        step_ms = suite.value(rows, config, "decode", "ms_per_step", batch_size=1)
        floor_ms = suite.value(rows, config, "decode", "moe_floor_ms", batch_size=1)
        if step_ms is not None:
            suite.print_target(f"{config}: moe_floor_ms / decode step at batch 1",
                               suite.ratio(floor_ms, step_ms), "≥ 0.70")


if __name__ == "__main__":
    suite.bench_main("bench_moe", __doc__, SETUPS,
                     {1: ["tp1"], 2: ["tp2", "ep2-allreduce", "ep2-alltoall"]}, report,
                     floors={"floor": decode_weight_bytes, "moe_floor": active_weight_bytes})
