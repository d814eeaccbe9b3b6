"""LLM / LLMEngine end to end on a tiny random Qwen3 (token-id prompts, no tokenizer)."""

import pytest
import torch

from bcg.engine.llm import LLM
from bcg.engine.sampling_params import SamplingParams
from bcg.engine.sequence import Sequence
from tests.hf_tiny import VOCAB, save_tiny_model_and_greedy

PROMPTS = [[(7 * i + 3 * j) % VOCAB for j in range(n)] for i, n in enumerate((5, 12, 30))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model_and_greedy("qwen3", tmp_path_factory.mktemp("qwen3"), PROMPTS,
                                      GREEDY.max_tokens)


def make_llm(folder, **engine_args) -> LLM:
    return LLM(model=str(folder), device="cpu", block_size=4, **engine_args)


def greedy_tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def llm(tiny):
    return make_llm(tiny[0], max_model_len=128)


def test_greedy_matches_transformers(llm, tiny):
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == tiny[1]
    assert all(o.outputs[0].finish_reason == "length" and o.finished for o in outputs)
    assert [o.prompt_token_ids for o in outputs] == PROMPTS


def test_batch_tensors_start_16_byte_aligned(llm):
    """Kernels specialise on pointer alignment: a misaligned batch field would compile a
    second variant and miss the fast launch path on every step."""
    engine = llm.engine
    seqs = [Sequence(str(i), list(range(1, 2 + i)), GREEDY) for i in range(3)]
    try:
        for seq in seqs:
            assert engine.scheduler.block_manager.try_allocate(seq, seq.num_tokens)
        batch = engine.runner.prepare(seqs, [seq.num_tokens for seq in seqs])
    finally:  # the engine is shared with the other tests: give the blocks back
        for seq in seqs:
            engine.scheduler.block_manager.free(seq)
    tensors = [v for v in vars(batch).values() if isinstance(v, torch.Tensor)]
    assert all(t.data_ptr() % 16 == 0 for t in tensors)


def test_chunked_prefill_gives_the_same_tokens(tiny):
    llm = make_llm(tiny[0], max_num_batched_tokens=7, max_model_len=128)
    assert greedy_tokens(llm) == tiny[1]


def test_preemption_gives_the_same_tokens(llm, tiny):
    """Two requests that grow to 15 blocks in a 12-block cache: one is preempted."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = greedy_tokens(llm, PROMPTS[:2], params)
    small = make_llm(tiny[0], kv_cache_tokens=48, max_model_len=48)
    assert greedy_tokens(small, PROMPTS[:2], params) == expected
    assert small.engine.stats.num_preemptions > 0
    free_blocks = small.engine.scheduler.block_manager.num_free_blocks
    assert free_blocks == small.engine.runner.num_kv_blocks


def test_prefix_cache_hit_gives_the_same_tokens(llm, tiny):
    [first] = llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False)
    [again] = llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False)
    assert again.num_cached_tokens == 28
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == tiny[1][2]


def test_seeded_request_is_reproducible_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=42, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    [alone] = greedy_tokens(llm, [PROMPTS[1]], seeded)
    batched = greedy_tokens(llm, [PROMPTS[0], PROMPTS[1], PROMPTS[2]], [other, seeded, other])
    assert batched[1] == alone
    reseeded = SamplingParams(temperature=1.0, max_tokens=12, seed=43, ignore_eos=True)
    assert greedy_tokens(llm, [PROMPTS[1]], reseeded)[0] != alone


def test_stop_token_ends_the_request(llm, tiny):
    stop_token = tiny[1][0][3]
    params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_token])
    [out] = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids == tiny[1][0][: tiny[1][0].index(stop_token) + 1]


def test_prompt_plus_max_tokens_beyond_max_model_len_is_refused(tiny):
    """As vLLM does (its server answers 400): a request that cannot finish is not started."""
    llm = make_llm(tiny[0], max_model_len=34)
    with pytest.raises(ValueError, match="plus max_tokens=10 exceed max_model_len=34"):
        llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False)
    fits = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    [out] = llm.generate([PROMPTS[2]], fits, use_tqdm=False)
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].token_ids == tiny[1][2][:4]


@pytest.mark.parametrize("prompt,message", [
    ([], "empty"),
    ([1, VOCAB], "outside the vocabulary"),
    ([1] * 200, "max_model_len"),
    ("some text", "no tokenizer"),
    ([1, 2.5], "token ids"),
])
def test_bad_prompt_raises_and_harms_no_other_request(llm, tiny, prompt, message):
    engine = llm.engine
    good = engine.add_request(PROMPTS[1], GREEDY)
    engine.step()
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, GREEDY)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished[good].outputs[0].token_ids == tiny[1][1]


def test_generate_validates_all_prompts_before_running_any(llm):
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate([PROMPTS[0], []], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate(PROMPTS, [GREEDY, GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.engine.add_request(PROMPTS[0], {"temperature": 0})
    for params in ({"max_tokens": 2}, "greedy", [GREEDY, {"max_tokens": 2}]):
        with pytest.raises(TypeError, match="sampling_params must (be a|hold) SamplingParams"):
            llm.generate(PROMPTS[:2], params, use_tqdm=False)


def test_abort_frees_blocks_and_others_finish(llm, tiny):
    engine = llm.engine
    doomed = engine.add_request(PROMPTS[2], GREEDY)
    kept = engine.add_request(PROMPTS[0], GREEDY)
    engine.step()
    engine.abort_request(doomed)
    engine.abort_request("no-such-request")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {kept}
    assert outputs[-1].outputs[0].token_ids == tiny[1][0]
    assert engine.scheduler.block_manager.num_free_blocks == engine.runner.num_kv_blocks


def test_duplicate_request_id_is_refused(llm):
    llm.engine.add_request(PROMPTS[0], GREEDY, request_id="same")
    with pytest.raises(ValueError, match="already in use"):
        llm.engine.add_request(PROMPTS[1], GREEDY, request_id="same")
    llm.engine.abort_request("same")


@pytest.mark.gpu
def test_greedy_on_cuda_fp32_matches_transformers(tiny):
    llm = LLM(model=str(tiny[0]), device="cuda", dtype="float32", block_size=4,
              max_model_len=128, gpu_memory_utilization=0.3)
    assert greedy_tokens(llm) == tiny[1]


@pytest.mark.gpu
def test_cuda_bf16_kv_cache_sized_from_memory_and_seeds_hold(tiny):
    import torch

    llm = LLM(model=str(tiny[0]), device="cuda", max_model_len=128, gpu_memory_utilization=0.3)
    storage = llm.engine.runner.kv_cache.storage
    assert storage.dtype == torch.bfloat16
    total = torch.cuda.mem_get_info()[1]
    assert 128 <= llm.engine.runner.num_kv_blocks * 16
    assert storage.numel() * storage.element_size() <= 0.3 * total
    seeded = SamplingParams(temperature=1.0, top_k=50, max_tokens=12, seed=7, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    [alone] = greedy_tokens(llm, [PROMPTS[1]], seeded)
    assert greedy_tokens(llm, PROMPTS, [other, seeded, other])[1] == alone


def test_progress_bar_shows_prefill_and_decode_throughput(llm, capsys):
    llm.generate(PROMPTS, GREEDY, use_tqdm=True)
    err = capsys.readouterr().err
    assert "prefill" in err and "decode" in err and "tok/s" in err


def test_tight_cache_budget_and_shared_prefixes_give_the_same_tokens(llm, tiny):
    """Chunked prefill, prefix hits, preemption and a seat limit all at once."""
    base = PROMPTS[2]
    prompts = [base[:n] + [i] for i, n in enumerate((4, 9, 16, 16, 23, 29, 8, 12))]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = greedy_tokens(llm, prompts, params)
    tight = make_llm(tiny[0], kv_cache_tokens=64, max_model_len=48, max_num_batched_tokens=9,
                     max_num_seqs=4)
    assert greedy_tokens(tight, prompts, params) == expected
    assert tight.engine.stats.num_preemptions > 0


@pytest.mark.gpu
@pytest.mark.parametrize("prefill_graph", ["none", "breakable", "piecewise"])
def test_repeated_steps_take_only_fast_kernel_launches(tiny, prefill_graph):
    """Once a workload has run, running it again compiles nothing and every kernel launch
    hits the launch cache (a batch tensor that changed alignment or a constexpr that follows
    the batch would miss it: a compile mid-serving, then a slow launch per call)."""
    import importlib

    from bcg.kernels._launch import CachedLauncher

    modules = ["activation", "decode_attention", "extend_attention", "kv_store", "rmsnorm",
               "rotary"]
    launchers = [value for name in modules
                 for value in vars(importlib.import_module(f"bcg.kernels.{name}")).values()
                 if isinstance(value, CachedLauncher)]
    llm = LLM(model=str(tiny[0]), device="cuda", max_model_len=128, gpu_memory_utilization=0.3,
              max_num_batched_tokens=32, prefill_graph=prefill_graph)
    greedy_tokens(llm)  # chunked prompts, mixed steps, decodes of 1..3 sequences
    slow_before = [launcher.slow_launches for launcher in launchers]
    greedy_tokens(llm)
    assert [launcher.slow_launches for launcher in launchers] == slow_before


def test_add_requests_is_all_or_none(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="prompt 2: "):
        engine.add_requests([PROMPTS[0], PROMPTS[1], [1, 2.5]], [GREEDY] * 3)
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        engine.add_requests(PROMPTS[:1] * 3, [GREEDY] * 2)
    ids = engine.add_requests(PROMPTS[:2], [GREEDY] * 2)
    assert len(set(ids)) == 2
    for request_id in ids:
        engine.abort_request(request_id)
    assert not engine.has_unfinished_requests()


def test_chat_without_a_tokenizer_says_to_name_one(llm):
    assert llm.engine.tokenizer is None
    with pytest.raises(ValueError, match="no tokenizer, which a chat needs: name one"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)


def test_step_finished_only_reports_each_request_once_when_it_ends(llm, tiny):
    engine = llm.engine
    ids = engine.add_requests(PROMPTS, [GREEDY] * len(PROMPTS))
    reported = []
    while engine.has_unfinished_requests():
        reported += engine.step(finished_only=True)
    assert all(o.finished for o in reported)
    assert sorted(o.request_id for o in reported) == sorted(ids)
    in_order = sorted(reported, key=lambda o: ids.index(o.request_id))
    assert [o.outputs[0].token_ids for o in in_order] == tiny[1]
