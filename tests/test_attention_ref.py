import pytest
import torch

from bcg.layers.attention_ref import paged_attention_ref, store_kv
from bcg.utils import cdiv
from tests.numerics import POISON, pad_with_nan, poisoned_like
from tests.paged import scatter_blocks, slot_mapping

BLOCK_SIZE = 4


def dense_causal_attention(q, k, v, scale):
    """Unpaged oracle: q are the last len(q) positions of k, v; GQA by repeating KV heads."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).double()
    v = v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("nhd,shd->hns", q.double(), k) * scale
    offset = k.shape[0] - q.shape[0]
    mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril(offset)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hns,shd->nhd", scores.softmax(-1), v)


def build_case(seq_lens, new_lens, num_heads=4, num_kv_heads=2, head_dim=8, seed=0):
    """Random K/V per sequence, scattered into shuffled cache blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [cdiv(s, BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    block_tables = scatter_blocks(blocks_per_seq, num_blocks, gen)
    ks, vs, qs = [], [], []
    for table, seq_len, new in zip(block_tables, seq_lens, new_lens, strict=True):
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        store_kv(k, v, k_cache, v_cache, slot_mapping(table, range(seq_len), BLOCK_SIZE))
        ks.append(k)
        vs.append(v)
        qs.append(torch.randn(new, num_heads, head_dim, generator=gen))
    cu = torch.tensor([0, *torch.tensor(new_lens).cumsum(0).tolist()], dtype=torch.int32)
    return dict(q=torch.cat(qs), k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=cu,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                block_tables=block_tables), ks, vs, qs


@pytest.mark.parametrize(
    "seq_lens,new_lens",
    [
        ([7], [7]),                      # plain prefill
        ([5, 9, 1], [5, 9, 1]),          # varlen prefill batch
        ([12, 6], [3, 6]),               # cached prefix + chunk, mixed with prefill
        ([9, 4, 17], [1, 1, 1]),         # decode
        ([8, 3, 10], [2, 0, 1]),         # a sequence with no new tokens is a no-op
    ],
)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_paged_attention_matches_dense(seq_lens, new_lens, num_heads, num_kv_heads):
    args, ks, vs, qs = build_case(seq_lens, new_lens, num_heads, num_kv_heads)
    scale = 0.3
    out = paged_attention_ref(**args, scale=scale)
    start = 0
    for k, v, q in zip(ks, vs, qs, strict=True):
        expected = dense_causal_attention(q, k, v, scale)
        torch.testing.assert_close(out[start : start + len(q)].double(), expected,
                                   rtol=1e-5, atol=1e-5)
        start += len(q)


def test_writes_into_out_and_leaves_padded_rows():
    args, *_ = build_case([6, 3], [2, 1])
    q = args.pop("q")
    padded_q = pad_with_nan(q, 2)
    out = poisoned_like(padded_q)
    result = paged_attention_ref(padded_q, **args, scale=1.0, out=out)
    assert result is out
    assert torch.isfinite(out[:3]).all()
    assert (out[3:] == POISON).all()


def test_zero_length_sequence_is_noop():
    args, *_ = build_case([5], [1])
    args["seq_lens"] = torch.tensor([0], dtype=torch.int32)
    out = poisoned_like(args["q"])
    paged_attention_ref(**args, scale=1.0, out=out)
    assert (out == POISON).all()


def test_store_kv_skips_negative_slots():
    k_cache = torch.zeros(2, BLOCK_SIZE, 1, 2)
    v_cache = torch.zeros_like(k_cache)
    k = torch.arange(6.0).view(3, 1, 2) + 1
    store_kv(k, -k, k_cache, v_cache, torch.tensor([5, -1, 0]))
    flat_k = k_cache.view(-1, 1, 2)
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_k[0], k[2])
    assert torch.equal(v_cache.view(-1, 1, 2)[5], -k[0])
    assert flat_k.abs().sum() == k[0].sum() + k[2].sum()


@pytest.mark.gpu
def test_paged_attention_cuda_bf16_matches_cpu_fp32():
    args, *_ = build_case([12, 6, 9], [3, 6, 1], num_heads=8, num_kv_heads=2, head_dim=64)
    expected = paged_attention_ref(**args, scale=0.125)
    cuda_args = {n: t.cuda() for n, t in args.items()}
    for name in ("q", "k_cache", "v_cache"):
        cuda_args[name] = cuda_args[name].bfloat16()
    out = paged_attention_ref(**cuda_args, scale=0.125)
    torch.testing.assert_close(out.float().cpu(), expected, rtol=2e-2, atol=2e-2)
