"""Our eager forward through the paged KV cache against Hugging Face transformers (fp32 on
the CPU, the reference). Tolerance on the relative error of logits (max |ours - ref| / max
|ref|): 1e-4 in fp32 on the CPU; 5e-3 in fp32 on CUDA, where the Triton attention's dots
round fp32 inputs to TF32 (10-bit mantissa); 3e-2 in bf16 on CUDA (8-bit mantissa; bf16 on
the CPU measures about 1e-2 on these models). The hybrid (NemotronH: Mamba2, attention and
MLP blocks, scan chunks of 8 tokens) carries its recurrent state through every step here."""

import pytest

from tests.hf_tiny import (
    ARCHS,
    HYBRID_ARCHS,
    RUNS,
    PagedHarness,
    assert_rows_match,
    random_prompt,
    save_tiny_model,
)


@pytest.fixture(scope="module", params=sorted(ARCHS) + sorted(HYBRID_ARCHS))
def hf_folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return save_tiny_model(request.param, folder), folder


@pytest.fixture(scope="module", params=RUNS)
def tiny(request, hf_folder):
    hf_model, folder = hf_folder
    device, dtype, tolerance = request.param
    return hf_model, PagedHarness(folder, device=device, dtype=dtype), tolerance


def test_prefill_batch_of_different_lengths(tiny):
    harness = tiny[1]
    seqs = [harness.new_sequence(random_prompt(n, seed=n)) for n in (5, 17, 33)]
    logits = harness.step(seqs, [s.num_tokens for s in seqs])
    for seq, rows in zip(seqs, logits, strict=True):
        assert_rows_match(tiny, seq, rows, 0)


def test_decode_steps_through_paged_cache(tiny):
    harness = tiny[1]
    seqs = [harness.new_sequence(random_prompt(n, seed=100 + n)) for n in (3, 9)]
    logits = harness.step(seqs, [s.num_tokens for s in seqs])
    for _ in range(6):
        for seq, rows in zip(seqs, logits, strict=True):
            seq.append_token(int(rows[-1].argmax()))
        logits = harness.step(seqs, [1, 1])
        for seq, rows in zip(seqs, logits, strict=True):
            assert_rows_match(tiny, seq, rows, seq.num_tokens - 1)


def test_prefix_cache_hit(tiny):
    harness = tiny[1]
    if harness.runner.num_state_slots:
        pytest.skip("prefix caching is off for models with recurrent state")
    first = harness.new_sequence(random_prompt(20, seed=7))
    harness.step([first], [first.num_tokens])
    second = harness.new_sequence(first.token_ids[:16] + random_prompt(7, seed=8))
    assert second.num_computed_tokens == 16
    assert second.block_table[:4] == first.block_table[:4]
    [rows] = harness.step([second], [second.num_uncomputed_tokens])
    assert_rows_match(tiny, second, rows, 16)


def test_chunked_prefill_mixed_with_decode(tiny):
    harness = tiny[1]
    decoding = harness.new_sequence(random_prompt(6, seed=11))
    [rows] = harness.step([decoding], [6])
    chunked = harness.new_sequence(random_prompt(30, seed=12))
    for chunk in (7, 1, 12, 10):
        decoding.append_token(int(rows[-1].argmax()))
        start = chunked.num_computed_tokens
        rows, chunk_rows = harness.step([decoding, chunked], [1, chunk])
        assert_rows_match(tiny, chunked, chunk_rows, start)
        assert_rows_match(tiny, decoding, rows, decoding.num_tokens - 1)
