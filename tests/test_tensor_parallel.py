"""Tensor parallelism on the CPU with gloo: a model split over 2, 4 or 8 processes gives the
logits of the unsplit model (fp32), for Llama (tied head, vocabulary padded), Qwen2
(biases), Qwen3 (q/k norms; at 4 ranks its 2 KV heads are replicated), Qwen3-MoE (at 2, 4
and 8 ranks: its experts split by intermediate dimension, or whole experts per rank: expert
parallel, by all-reduce or all-to-all dispatch) and NemotronH (Mamba2 heads, groups, conv
channels and the gated norm split; state carried into the decode), with loaded and with
dummy weights."""

import pytest
import torch

from bcg.distributed.parallel_state import TensorParallel
from tests.hf_tiny import VOCAB, save_tiny_model
from tests.numerics import relative_error
from tests.split_runs import expert_shapes, split_runs, step_logits

TOLERANCE = 1e-5

# The runs of a case: tensor parallel; MoE also with whole experts per rank, both dispatches.
# All-to-all with fixed blocks up to 3 tokens: the prefill (26 tokens) exchanges counted
# rows, the decode steps (3 and 1 tokens) fixed-size blocks; by default (MOE_MODES_ALL's
# last: up to 2048 tokens) every step fixed-size blocks.
TENSOR_PARALLEL = ({},)
ALLTOALL = {"enable_expert_parallel": True, "ep_dispatch": "alltoall"}
MOE_MODES = TENSOR_PARALLEL + ({"enable_expert_parallel": True, "ep_dispatch": "allreduce"},
                              {**ALLTOALL, "max_num_seqs": 3, "ep_fixed_block_tokens": 3})
MOE_MODES_ALL = MOE_MODES + (ALLTOALL,)


# id: (arch, tensor-parallel size, config overrides, load_format, modes)
CASES = {
    "llama": ("llama", 2, {"vocab_size": VOCAB + 1}, "auto", TENSOR_PARALLEL),  # last padded
    "qwen2": ("qwen2", 2, {}, "auto", TENSOR_PARALLEL),
    "qwen3": ("qwen3", 2, {}, "auto", TENSOR_PARALLEL),
    # 4 heads, 2 KV heads: each KV head on two ranks
    "qwen3-tp4": ("qwen3", 4, {}, "auto", TENSOR_PARALLEL),
    # experts split, then experts 0-1 and 2-3 per rank by all-reduce and by all-to-all (both
    # exchanges)
    "qwen3_moe": ("qwen3_moe", 2, {}, "auto", MOE_MODES_ALL),
    # at 4 ranks: a quarter of each expert, then one whole expert per rank
    "qwen3_moe-tp4": ("qwen3_moe", 4, {}, "auto", MOE_MODES),
    # at 8 ranks (issue 21's sizes): each of the 2 KV heads on four ranks, an eighth of each
    # expert, then one whole expert per rank
    "qwen3_moe-tp8": ("qwen3_moe", 8, {"num_attention_heads": 8, "num_experts": 8,
                                       "moe_intermediate_size": 64}, "auto", MOE_MODES),
    # Mamba heads and groups split: 4 heads and 1 group per rank
    "nemotron_h": ("nemotron_h", 2, {}, "auto", TENSOR_PARALLEL),
    # random weights split like loaded ones
    "qwen2-dummy": ("qwen2", 2, {"vocab_size": VOCAB + 1}, "dummy", TENSOR_PARALLEL),
    "qwen3_moe-dummy": ("qwen3_moe", 2, {}, "dummy", MOE_MODES),
    "nemotron_h-dummy": ("nemotron_h", 2, {}, "dummy", TENSOR_PARALLEL),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple]:
    """Each case's (folder, rank 0's results per run): every case of one size in one spawn."""
    root = tmp_path_factory.mktemp("tensor_parallel")
    folders = {}
    for case, (arch, _, overrides, _, _) in CASES.items():
        folders[case] = root / case
        save_tiny_model(arch, folders[case], **overrides)
    results = {}
    for size in sorted({case[1] for case in CASES.values()}):
        ids = [case for case, spec in CASES.items() if spec[1] == size]
        cases = [(str(folders[case]), [{"load_format": CASES[case][3], **mode}
                                       for mode in CASES[case][4]]) for case in ids]
        for case, result in zip(ids, split_runs(size, "cpu", cases, root / f"tp{size}.pt"),
                                strict=True):
            results[case] = (folders[case], result)
    return results


@pytest.mark.parametrize("case", list(CASES))
def test_split_model_gives_the_unsplit_logits(runs, case):
    folder, results = runs[case]
    _, size, _, load_format, modes = CASES[case]
    expected, model = step_logits(str(folder), load_format=load_format)
    for mode, (logits, shapes) in zip(modes, results, strict=True):
        for ours, ref in zip(logits, expected, strict=True):
            assert relative_error(ours, ref) <= TOLERANCE
        # Expert parallel: a share of the experts, whole; else every expert, a share of each.
        assert shapes == [(e // size, i, h) if mode.get("enable_expert_parallel")
                          else (e, i // size, h)
                          for e, i, h in expert_shapes(model)]


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
