"""Tensor parallelism on the CPU with gloo: a model split over 2 (or 4) processes gives the
logits of the unsplit model (fp32), for Llama (tied head, vocabulary padded), Qwen2
(biases), Qwen3 (q/k norms; at 4 ranks its 2 KV heads are replicated), Qwen3-MoE (its
experts split by intermediate dimension, or whole experts per rank: expert parallel, by
all-reduce or all-to-all dispatch) and NemotronH (Mamba2 heads, groups, conv channels and the
gated norm split; state carried into the decode), with loaded and with dummy weights."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from bcg.distributed.parallel_state import (
    TensorParallel,
    destroy_tensor_parallel,
    init_tensor_parallel,
)
from bcg.layers.fused_moe import FusedMoE
from tests.hf_tiny import VOCAB, PagedHarness, save_tiny_model
from tests.numerics import relative_error
from tests.server_process import free_port

PROMPTS = [[(7 * i + 3 * j) % VOCAB for j in range(n)] for i, n in enumerate((5, 12, 9))]
TOLERANCE = 1e-5


def step_logits(folder, load_format: str, **engine_args
                ) -> tuple[list[torch.Tensor], torch.nn.Module]:
    """Prefill every prompt, one decode step of each, then one of the first alone (a single
    token: fewer than the ranks): the logits of every row, and the model."""
    harness = PagedHarness(folder, load_format=load_format, **engine_args)
    seqs = [harness.new_sequence(list(p)) for p in PROMPTS]
    prefill = harness.step(seqs, [len(p) for p in PROMPTS])
    for seq, rows in zip(seqs, prefill, strict=True):
        seq.append_token(int(rows[-1].argmax()))
    decode = harness.step(seqs, [1] * len(seqs))
    seqs[0].append_token(int(decode[0][-1].argmax()))
    return prefill + decode + harness.step(seqs[:1], [1]), harness.runner.model


def expert_shapes(model: torch.nn.Module) -> list[tuple[int, ...]]:
    return [tuple(m.gate_up_proj.shape) for m in model.modules() if isinstance(m, FusedMoE)]


def rank_main(rank: int, size: int, port: int, folder, load_format: str, out_path,
              modes: tuple[tuple[bool, str], ...]) -> None:
    """Build and run the model once per (expert parallel, dispatch) mode (one process group
    for all: spawning is slow)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(size))
    torch.set_num_threads(1)
    init_tensor_parallel(size, "gloo")
    results = []
    try:
        for expert_parallel, dispatch in modes:
            logits, model = step_logits(folder, load_format,
                                        enable_expert_parallel=expert_parallel,
                                        ep_dispatch=dispatch)
            results.append((logits, expert_shapes(model)))
        if rank == 0:
            torch.save(results, out_path)
    finally:
        destroy_tensor_parallel()


@pytest.mark.parametrize("arch,size,overrides,load_format", [
    ("llama", 2, {"vocab_size": VOCAB + 1}, "auto"),  # 161 rows: the last rank's is padded
    ("qwen2", 2, {}, "auto"),
    ("qwen3", 2, {}, "auto"),
    ("qwen3", 4, {}, "auto"),  # 4 heads, 2 KV heads: each KV head on two ranks
    # Tensor parallel, then expert parallel (experts 0-1, 2-3) by all-reduce and all-to-all.
    ("qwen3_moe", 2, {}, "auto"),
    ("nemotron_h", 2, {}, "auto"),  # Mamba heads and groups split: 4 heads, 1 group per rank
    ("qwen2", 2, {"vocab_size": VOCAB + 1}, "dummy"),  # random weights split like loaded ones
    ("qwen3_moe", 2, {}, "dummy"),
])
def test_split_model_gives_the_unsplit_logits(tmp_path, arch, size, overrides, load_format):
    save_tiny_model(arch, tmp_path, **overrides)
    expected, model = step_logits(tmp_path, load_format)
    out_path = tmp_path / "rank0.pt"
    modes = ((False, "allreduce"),)
    if arch == "qwen3_moe":
        modes += ((True, "allreduce"), (True, "alltoall"))
    mp.spawn(rank_main, args=(size, free_port(), tmp_path, load_format, out_path, modes),
             nprocs=size, join=True)
    for (expert_parallel, _), (logits, shapes) in zip(modes, torch.load(out_path), strict=True):
        for ours, ref in zip(logits, expected, strict=True):
            assert relative_error(ours, ref) <= TOLERANCE
        # Expert parallel: a share of the experts, whole; else every expert, a share of each.
        assert shapes == [(e // size, i, h) if expert_parallel else (e, i // size, h)
                          for e, i, h in expert_shapes(model)]


def test_bad_sizes_are_clear_errors():
    with pytest.raises(ValueError, match="num_attention_heads .* not divisible by .* 3"):
        TensorParallel(0, 3).shard(4, "num_attention_heads")
    with pytest.raises(ValueError, match="3 KV heads cannot be replicated evenly over 4"):
        TensorParallel(0, 4).kv_heads(3)
    assert TensorParallel(1, 4).kv_heads(2) == 1 and TensorParallel(1, 2).kv_heads(8) == 4
