"""NemotronH (a Mamba2 hybrid with every block kind) against transformers' PyTorch path: our
runner stepped by hand (prefill, chunked prefill mixed with decodes, decode), then the engine
(greedy tokens, chunking, preemption and abort giving back every state slot). Tolerances as
in test_models_hf."""

import pytest
import torch

from bcg.engine.llm import LLM
from bcg.engine.sampling_params import SamplingParams
from bcg.layers.mamba_backend import MambaBackend, MambaOps
from tests.hf_tiny import VOCAB, PagedHarness, hf_greedy, hf_logits, save_tiny_model
from tests.kernels_support import kernels_skip_reason
from tests.numerics import relative_error

RUNS = [
    pytest.param(("cpu", "float32", 1e-4), id="cpu-fp32"),
    pytest.param(("cuda", "float32", 5e-3), id="cuda-fp32", marks=pytest.mark.gpu),
    pytest.param(("cuda", "bfloat16", 3e-2), id="cuda-bf16", marks=pytest.mark.gpu),
]
PROMPTS = [[(7 * i + 3 * j) % VOCAB for j in range(n)] for i, n in enumerate((5, 12, 30))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("nemotron_h")
    return save_tiny_model("nemotron_h", folder), folder


@pytest.fixture(scope="module", params=RUNS)
def tiny(request, hf_folder):
    hf_model, folder = hf_folder
    device, dtype, tolerance = request.param
    return hf_model, PagedHarness(folder, device=device, dtype=dtype), tolerance


def random_prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (length,), generator=generator).tolist()


def assert_rows_match(tiny, seq, rows: torch.Tensor, start: int) -> None:
    hf_model, _, tolerance = tiny
    ref = hf_logits(hf_model, seq.token_ids[: start + len(rows)])[start:]
    assert relative_error(rows.cpu(), ref) <= tolerance


def test_prefill_batch_spanning_several_chunks(tiny):
    harness = tiny[1]
    seqs = [harness.new_sequence(random_prompt(n, seed=n)) for n in (5, 17, 33)]
    logits = harness.step(seqs, [s.num_tokens for s in seqs])
    for seq, rows in zip(seqs, logits, strict=True):
        assert_rows_match(tiny, seq, rows, 0)
    for seq in seqs:
        harness.block_manager.free(seq)


def test_decode_steps_carry_the_state(tiny):
    harness = tiny[1]
    seqs = [harness.new_sequence(random_prompt(n, seed=100 + n)) for n in (3, 9, 20)]
    logits = harness.step(seqs, [s.num_tokens for s in seqs])
    for _ in range(5):
        for seq, rows in zip(seqs, logits, strict=True):
            seq.append_token(int(rows[-1].argmax()))
        logits = harness.step(seqs, [1] * len(seqs))
        for seq, rows in zip(seqs, logits, strict=True):
            assert_rows_match(tiny, seq, rows, seq.num_tokens - 1)
    for seq in seqs:
        harness.block_manager.free(seq)


def test_chunked_prefill_mixed_with_decode(tiny):
    """Chunks of 7, 1, 2, 10 and 10 tokens: boundaries inside and across the scan's 8-token
    chunks and shorter than the conv's window; the state carries between them."""
    harness = tiny[1]
    decoding = harness.new_sequence(random_prompt(6, seed=11))
    [rows] = harness.step([decoding], [6])
    chunked = harness.new_sequence(random_prompt(30, seed=12))
    for chunk in (7, 1, 2, 10, 10):
        decoding.append_token(int(rows[-1].argmax()))
        start = chunked.num_computed_tokens
        rows, chunk_rows = harness.step([decoding, chunked], [1, chunk])
        assert_rows_match(tiny, chunked, chunk_rows, start)
        assert_rows_match(tiny, decoding, rows, decoding.num_tokens - 1)
    for seq in (decoding, chunked):
        harness.block_manager.free(seq)
    pool = harness.block_manager.state_slots
    assert pool.num_free == pool.num_slots


@pytest.fixture(scope="module")
def greedy(hf_folder):
    hf_model, folder = hf_folder
    return folder, [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in PROMPTS]


def make_llm(folder, **engine_args) -> LLM:
    return LLM(model=str(folder), device="cpu", block_size=4, **engine_args)


def greedy_tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_all_freed(llm: LLM) -> None:
    manager = llm.engine.scheduler.block_manager
    assert manager.num_free_blocks == llm.engine.runner.num_kv_blocks
    assert manager.state_slots.num_free == manager.state_slots.num_slots


def test_engine_greedy_and_chunked_match_transformers(greedy, caplog):
    folder, expected = greedy
    with caplog.at_level("INFO"):
        llm = make_llm(folder, max_model_len=128, max_num_batched_tokens=7)
    assert "prefix caching is off" in caplog.text
    assert not llm.engine.scheduler.block_manager.enable_prefix_caching
    assert greedy_tokens(llm) == expected
    assert_all_freed(llm)


def test_engine_preemption_and_abort_free_every_slot(greedy):
    folder, _ = greedy
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    roomy = make_llm(folder, max_model_len=48)
    expected = greedy_tokens(roomy, PROMPTS[:2], params)
    small = make_llm(folder, kv_cache_tokens=48, max_model_len=48, max_num_seqs=2)
    assert greedy_tokens(small, PROMPTS[:2], params) == expected
    assert small.engine.stats.num_preemptions > 0
    assert_all_freed(small)
    engine = small.engine
    doomed = engine.add_request(PROMPTS[1], GREEDY)
    kept = engine.add_request(PROMPTS[0], GREEDY)
    engine.step()
    assert engine.scheduler.block_manager.state_slots.num_free == 0
    engine.abort_request(doomed)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {kept}
    assert outputs[-1].outputs[0].token_ids == expected[0][: GREEDY.max_tokens]
    assert_all_freed(small)


def test_triton_kernels_in_the_model_match_transformers(hf_folder):
    """The mixer's state ops through our Triton kernels (the interpreter without a GPU): a
    prefill of two prompts (one over several chunks), then a decode step of both."""
    reason = kernels_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    from bcg.layers import triton_ops  # after kernels_support turned the interpreter on

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf_model, folder = hf_folder
    harness = PagedHarness(folder, device=device)
    harness.runner.mamba = MambaBackend(MambaOps(
        triton_ops.causal_conv1d_varlen, triton_ops.causal_conv1d_update,
        triton_ops.ssd_scan_varlen, triton_ops.selective_state_update))
    tiny = (hf_model, harness, 5e-3 if device == "cuda" else 1e-4)
    seqs = [harness.new_sequence(random_prompt(n, seed=n)) for n in (3, 19)]
    logits = harness.step(seqs, [3, 19])
    for seq, rows in zip(seqs, logits, strict=True):
        assert_rows_match(tiny, seq, rows, 0)
        seq.append_token(int(rows[-1].argmax()))
    for seq, rows in zip(seqs, harness.step(seqs, [1, 1]), strict=True):
        assert_rows_match(tiny, seq, rows, seq.num_tokens - 1)
