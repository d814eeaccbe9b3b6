"""Tensor parallelism on the CPU with gloo: a model split over 2 (or 4) processes gives the
logits of the unsplit model (fp32), for Llama (tied head, vocabulary padded), Qwen2
(biases) and Qwen3 (q/k norms; at 4 ranks its 2 KV heads are replicated), with loaded and
with dummy weights."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from bcg.distributed.parallel_state import (
    TensorParallel,
    destroy_tensor_parallel,
    init_tensor_parallel,
)
from tests.hf_tiny import VOCAB, PagedHarness, save_tiny_model
from tests.numerics import relative_error
from tests.server_process import free_port

PROMPTS = [[(7 * i + 3 * j) % VOCAB for j in range(n)] for i, n in enumerate((5, 12, 9))]
TOLERANCE = 1e-5


def step_logits(folder, load_format: str) -> list[torch.Tensor]:
    """Prefill every prompt, then one decode step of each: the logits of every row."""
    harness = PagedHarness(folder, load_format=load_format)
    seqs = [harness.new_sequence(list(p)) for p in PROMPTS]
    prefill = harness.step(seqs, [len(p) for p in PROMPTS])
    for seq, rows in zip(seqs, prefill, strict=True):
        seq.append_token(int(rows[-1].argmax()))
    return prefill + harness.step(seqs, [1] * len(seqs))


def rank_main(rank: int, size: int, port: int, cases: list[tuple], out_path) -> None:
    """One rank of one process group: each case's model (folder, load_format) built in
    turn, rank 0 saving every case's logits."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(size))
    torch.set_num_threads(1)
    init_tensor_parallel(size, "gloo")
    try:
        logits = [step_logits(folder, load_format) for folder, load_format in cases]
        if rank == 0:
            torch.save(logits, out_path)
    finally:
        destroy_tensor_parallel()


# id: (arch, tensor-parallel size, config overrides, load_format)
CASES = {
    "llama": ("llama", 2, {"vocab_size": VOCAB + 1}, "auto"),  # 161 rows: the last rank's padded
    "qwen2": ("qwen2", 2, {}, "auto"),
    "qwen3": ("qwen3", 2, {}, "auto"),
    "qwen3-tp4": ("qwen3", 4, {}, "auto"),  # 4 heads, 2 KV heads: each KV head on two ranks
    "qwen2-dummy": ("qwen2", 2, {"vocab_size": VOCAB + 1}, "dummy"),  # split like loaded ones
}


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory) -> dict[str, tuple]:
    """Each case's (folder, rank 0's logits): every case of one size in one spawn of its
    processes (spawning costs more than the tiny models)."""
    root = tmp_path_factory.mktemp("tensor_parallel")
    folders = {}
    for case, (arch, _, overrides, _) in CASES.items():
        folders[case] = root / case
        save_tiny_model(arch, folders[case], **overrides)
    runs = {}
    for size in sorted({size for _, size, _, _ in CASES.values()}):
        ids = [case for case, (_, n, _, _) in CASES.items() if n == size]
        out_path = root / f"tp{size}.pt"
        cases = [(folders[case], CASES[case][3]) for case in ids]
        mp.spawn(rank_main, args=(size, free_port(), cases, out_path), nprocs=size, join=True)
        for case, logits in zip(ids, torch.load(out_path), strict=True):
            runs[case] = (folders[case], logits)
    return runs


@pytest.mark.parametrize("case", list(CASES))
def test_split_model_gives_the_unsplit_logits(split_runs, case):
    folder, split = split_runs[case]
    expected = step_logits(folder, CASES[case][3])
    for ours, ref in zip(split, expected, strict=True):
        assert relative_error(ours, ref) <= TOLERANCE


def test_bad_sizes_are_clear_errors():
    with pytest.raises(ValueError, match="num_attention_heads .* not divisible by .* 3"):
        TensorParallel(0, 3).shard(4, "num_attention_heads")
    with pytest.raises(ValueError, match="3 KV heads cannot be replicated evenly over 4"):
        TensorParallel(0, 4).kv_heads(3)
    assert TensorParallel(1, 4).kv_heads(2) == 1 and TensorParallel(1, 2).kv_heads(8) == 4


def test_row_parallel_linear_unsplit_adds_its_bias():
    from bcg.layers.linear import RowParallelLinear

    layer = RowParallelLinear(6, 4, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(3, 6)
    torch.testing.assert_close(layer(x), x @ layer.weight.T + layer.bias)


def test_a_rank_refuses_a_weight_that_is_not_the_whole_checkpoint_tensor(monkeypatch):
    """A rank loads its part of each whole tensor; a tensor of its part's size (or any other
    shape) is an error naming the weight and the whole shape, not loaded as it is."""
    from bcg.distributed import parallel_state
    from bcg.layers.embedding import Embedding
    from bcg.layers.linear import ColumnParallelLinear, RowParallelLinear

    monkeypatch.setattr(parallel_state, "_current", TensorParallel(1, 2))
    column, row = ColumnParallelLinear(8, [6, 4]), RowParallelLinear(6, 8)
    embedding = Embedding(10, 8)
    cases = [(column.load_weight, "q.weight", (3, 8), (6, 8)),
             (row.load_weight, "o.weight", (8, 3), (8, 6)),
             (embedding.load_weight, "embed.weight", (5, 8), (10, 8))]
    for load, name, local, whole in cases:
        with pytest.raises(ValueError, match=rf"'{name}' has shape \(\d+, \d+\), the model "
                                             rf"expects \({whole[0]}, {whole[1]}\)"):
            load(name, torch.zeros(local))
    column.load_weight("k.weight", torch.arange(32.0).view(4, 8), block=1)
    torch.testing.assert_close(column.weight[3:], torch.arange(16.0, 32.0).view(2, 8))
