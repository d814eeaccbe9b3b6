"""Overlapped steps (`overlap=True`: the host issues step N+1 before it reads step N's tokens,
which feed N+1 on the device) give exactly the outputs of plain steps, on the CPU too: the
same tokens, finish reasons, logprobs and prompt logprobs, through chunked prefill, prefix
hits, preemption, stop and EOS tokens, min_tokens, penalties, max_tokens of 0 and 1, seeded
sampling and aborts. A token drawn after its request stopped is never emitted."""

import pytest

from bcg.engine.llm import LLM
from bcg.engine.sampling_params import SamplingParams
from tests.hf_tiny import VOCAB, save_tiny_model_and_greedy

PROMPTS = [[(7 * i + 3 * j + 1) % VOCAB for j in range(n)] for i, n in enumerate((5, 12, 30, 1))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model_and_greedy("qwen3", tmp_path_factory.mktemp("qwen3"), PROMPTS,
                                      GREEDY.max_tokens)


def engines(folder, device: str = "cpu", **engine_args) -> tuple[LLM, LLM]:
    """(plain, overlapped) engines of the same arguments."""
    return tuple(LLM(model=str(folder), device=device, block_size=4, overlap=overlap,
                     **engine_args) for overlap in (False, True))


def workload(greedy: list[list[int]]) -> tuple[list[list[int]], list[SamplingParams]]:
    """Every way a request can stop or be sampled, on the tiny model's prompts."""
    stop_token = greedy[1][3]
    eos = greedy[0][5]
    cases = [
        (0, GREEDY),
        (1, SamplingParams(temperature=0, max_tokens=1)),
        (2, SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=12, seed=7,
                           ignore_eos=True)),
        (1, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_token])),
        (1, SamplingParams(temperature=0, max_tokens=10, min_tokens=6,
                           stop_token_ids=[stop_token])),
        (0, SamplingParams(temperature=0, max_tokens=10)),  # stops at the model's EOS
        (0, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, min_tokens=2,
                           stop_token_ids=[eos])),
        (2, SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3,
                           presence_penalty=0.5, ignore_eos=True)),
        (3, SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)),
        (2, SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=1)),
        (1, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, ignore_eos=True)),
        (3, SamplingParams(temperature=1.0, max_tokens=9, seed=11, ignore_eos=True)),
    ]
    return [PROMPTS[i] for i, _ in cases], [p for _, p in cases]


def assert_same_outputs(got, expected) -> None:
    """Tokens, finish reasons, the tokens and ranks of logprobs exactly; logprob values to
    float rounding (a step's batch differs by the rows of requests that stopped a step
    earlier). Not the cached prefix: which blocks are still cached depends on when blocks
    were freed, a step later under overlap."""
    for g, e in zip(got, expected, strict=True):
        assert (g.outputs[0].token_ids, g.outputs[0].finish_reason) == \
            (e.outputs[0].token_ids, e.outputs[0].finish_reason)
        for positions in ("logprobs", "prompt_logprobs"):
            mine = getattr(g.outputs[0] if positions == "logprobs" else g, positions)
            theirs = getattr(e.outputs[0] if positions == "logprobs" else e, positions)
            assert logprob_ranks(mine) == logprob_ranks(theirs)
            assert logprob_values(mine) == pytest.approx(logprob_values(theirs), abs=1e-4)


def logprob_ranks(positions) -> list | None:
    return None if positions is None else [
        None if p is None else {t: lp.rank for t, lp in p.items()} for p in positions]


def logprob_values(positions) -> list[float]:
    return [lp.logprob for p in positions or [] if p is not None for lp in p.values()]


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory, tiny):
    """The tiny model with one of its greedy tokens as EOS, so some requests stop on it."""
    folder = tmp_path_factory.mktemp("qwen3_eos")
    from tests.hf_tiny import save_tiny_model

    save_tiny_model("qwen3", folder, eos_token_id=tiny[1][0][5])
    return folder


@pytest.mark.parametrize("engine_args", [
    dict(max_model_len=64),
    dict(max_model_len=64, max_num_batched_tokens=7),  # chunked prefill
    dict(kv_cache_tokens=64, max_model_len=48, max_num_seqs=4),  # preemption, seat limit
], ids=["whole", "chunked", "preempting"])
def test_overlapped_steps_give_the_same_outputs(tiny, eos_model, engine_args):
    plain, overlapped = engines(eos_model, **engine_args)
    prompts, params = workload(tiny[1])
    for _ in range(2):  # the second round hits the prefix cache
        expected = plain.generate(prompts, params, use_tqdm=False)
        got = overlapped.generate(prompts, params, use_tqdm=False)
        assert_same_outputs(got, expected)
    assert {o.outputs[0].finish_reason for o in got} == {"stop", "length"}
    assert sum(o.num_cached_tokens for o in got) > 0
    manager = overlapped.engine.scheduler.block_manager
    assert manager.num_free_blocks == overlapped.engine.runner.num_kv_blocks


@pytest.mark.gpu
def test_overlapped_steps_on_cuda_give_the_same_outputs(tiny, eos_model):
    """On CUDA (fp32, default graphs): tokens fed on the device, ids copied through pinned
    memory and an event."""
    # A fixed cache size: both engines live in one process, and a memory fraction would
    # leave the second one nothing.
    plain, overlapped = engines(eos_model, device="cuda", dtype="float32", max_model_len=64,
                                kv_cache_tokens=1024)
    prompts, params = workload(tiny[1])
    for _ in range(2):
        expected = plain.generate(prompts, params, use_tqdm=False)
        assert_same_outputs(overlapped.generate(prompts, params, use_tqdm=False), expected)
    assert overlapped.engine.runner.forward_counts["decode graph"] > 0


def test_preemption_happens_under_overlap(tiny):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain, overlapped = engines(tiny[0], kv_cache_tokens=48, max_model_len=48)
    expected = plain.generate(PROMPTS[:2], params, use_tqdm=False)
    assert_same_outputs(overlapped.generate(PROMPTS[:2], params, use_tqdm=False), expected)
    assert overlapped.engine.stats.num_preemptions > 0


def test_streamed_outputs_grow_by_known_tokens_and_aborts_emit_nothing_more(tiny):
    """Stepping by hand: each output holds only tokens the host has; an aborted request
    emits nothing after its abort, and its blocks come back."""
    _, overlapped = engines(tiny[0], max_model_len=64)
    engine = overlapped.engine
    doomed = engine.add_request(PROMPTS[2], GREEDY)
    kept = engine.add_request(PROMPTS[0], GREEDY)
    seen = {doomed: [], kept: []}
    for _ in range(3):
        for output in engine.step():
            seen[output.request_id].append(output.outputs[0].token_ids)
    engine.abort_request(doomed)
    aborted_at = len(seen[doomed])
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id].append(output.outputs[0].token_ids)
    assert len(seen[doomed]) == aborted_at
    assert seen[kept][-1] == tiny[1][0]
    assert all(-1 not in tokens for tokens in seen[kept] + seen[doomed])
    assert all(tiny[1][0][: len(t)] == t for t in seen[kept])
    assert engine.scheduler.block_manager.num_free_blocks == engine.runner.num_kv_blocks


def test_a_step_issued_for_a_stopped_request_is_dropped(tiny):
    """A request that stops at step N was already in step N+1 (the host learns of the stop
    too late): that token is never emitted, and the request is reported finished once."""
    stop_token = tiny[1][1][3]
    params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_token])
    _, overlapped = engines(tiny[0], max_model_len=64)
    engine = overlapped.engine
    request = engine.add_request(PROMPTS[1], params)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    [output] = finished
    assert output.request_id == request
    assert output.outputs[0].token_ids == tiny[1][1][:4]
    assert output.outputs[0].finish_reason == "stop"


def test_overlap_defaults_to_cuda_only():
    from bcg.config import EngineConfig

    assert EngineConfig(device="cpu").overlaps_steps is False
    assert EngineConfig(device="cpu", overlap=True).overlaps_steps is True
