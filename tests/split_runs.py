"""A model split over N processes, stepped by hand: each rank builds the same paged harness
on its device (gloo on the CPU, NCCL on GPU r for rank r) and runs the same steps; rank 0's
logits come back. Used by the CPU tensor-parallel tests and the multi-GPU tests."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.multiprocessing as mp

from bcg.distributed.parallel_state import (
    destroy_tensor_parallel,
    init_tensor_parallel,
    tensor_parallel,
)
from bcg.layers.fused_moe import FusedMoE
from tests.hf_tiny import VOCAB, PagedHarness
from tests.server_process import free_port

PROMPTS = [[(7 * i + 3 * j) % VOCAB for j in range(n)] for i, n in enumerate((5, 12, 9))]
# The tokens the decode steps take, fixed: runs whose logits differ by rounding (bf16, other
# ranks) still decode the same tokens, so their decode logits compare too.
NEXT_TOKENS = [11, 23, 37]

# A case: a model (folder or preset) and the engine arguments of each run of it.
Case = tuple[str, list[dict]]
# Per run: every row's logits (on the CPU) and the shapes of the experts on rank 0.
RunResult = tuple[list[torch.Tensor], list[tuple[int, ...]]]


def step_logits(model: str, device: str = "cpu", **engine_args
                ) -> tuple[list[torch.Tensor], torch.nn.Module]:
    """Prefill every prompt, one decode step of each, then one of the first alone (a single
    token: fewer than the ranks): the logits of every row, and the model. On CUDA the
    runner (its graphs) is closed before returning."""
    harness = PagedHarness(model, device=device, **engine_args)
    if torch.device(device).type == "cuda" and tensor_parallel().size > 1:
        # a fallback to NCCL would pass as well: each run must test what it names
        kernel_off = engine_args.get("disable_custom_all_reduce") and not engine_args.get(
            "enable_torch_symm_mem")
        assert (tensor_parallel().custom_all_reduce is None) == bool(kernel_off), \
            "the all-reduce kernel asked for is not the one running"
    try:
        seqs = [harness.new_sequence(list(p)) for p in PROMPTS]
        prefill = harness.step(seqs, [len(p) for p in PROMPTS])
        for seq, token in zip(seqs, NEXT_TOKENS, strict=True):
            seq.append_token(token)
        decode = harness.step(seqs, [1] * len(seqs))
        seqs[0].append_token(NEXT_TOKENS[0])
        logits = prefill + decode + harness.step(seqs[:1], [1])
        return [rows.cpu() for rows in logits], harness.runner.model
    finally:
        if torch.device(device).type == "cuda":
            harness.runner.close()  # graphs that captured collectives go before the group


def expert_shapes(model: torch.nn.Module) -> list[tuple[int, ...]]:
    return [tuple(m.gate_up_proj.shape) for m in model.modules() if isinstance(m, FusedMoE)]


def rank_main(rank: int, size: int, port: int, device_type: str, cases: list[Case],
              out_path: Path) -> None:
    """One rank of one process group: each case's runs in turn, rank 0 saving the results."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(size))
    if device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        init_tensor_parallel(size, "nccl", device=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        init_tensor_parallel(size, "gloo")
    try:
        results = []
        for model, runs in cases:
            per_run = []
            for engine_args in runs:
                logits, harness_model = step_logits(model, str(device), **engine_args)
                per_run.append((logits, expert_shapes(harness_model)))
            results.append(per_run)
        if rank == 0:
            torch.save(results, out_path)
    finally:
        destroy_tensor_parallel()


def split_runs(size: int, device_type: str, cases: list[Case], out_path: Path
               ) -> list[list[RunResult]]:
    """Every case's runs over `size` ranks (one spawn of the processes: spawning costs more
    than tiny models): per case, per run, rank 0's result."""
    mp.spawn(rank_main, args=(size, free_port(), device_type, cases, out_path), nprocs=size,
             join=True)
    return torch.load(out_path)
