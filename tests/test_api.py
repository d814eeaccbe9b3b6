"""vLLM's Python API: exports, output shape, SamplingParams' fields and checks, logprobs,
prompt logprobs, penalties and the rest of sampling, on a tiny random Qwen3 (CPU, fp32)."""

import dataclasses
import math
import subprocess
import sys

import pytest
import torch

from bcg import LLM, CompletionOutput, RequestOutput, SamplingParams
from bcg.config import EngineConfig
from tests.hf_tiny import VOCAB, hf_logits, save_tiny_model

PROMPT = [(11 * j + 5) % VOCAB for j in range(20)]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3")
    return folder, save_tiny_model("qwen3", folder)


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(model=str(tiny[0]), device="cpu", block_size=4, max_model_len=128)


def generate(llm, params, prompts=(PROMPT,)):
    return llm.generate([list(p) for p in prompts], params, use_tqdm=False)


def test_import_bcg_is_light_and_exports_the_api():
    script = "import sys, bcg; assert 'torch' not in sys.modules; from bcg import LLM"
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_outputs_have_vllms_shape(llm):
    [out] = generate(llm, GREEDY)
    assert isinstance(out, RequestOutput) and out.finished and out.prompt_token_ids == PROMPT
    [completion] = out.outputs
    assert isinstance(completion, CompletionOutput) and completion.index == 0
    assert len(completion.token_ids) == 6 and completion.finish_reason == "length"
    assert completion.logprobs is None and out.prompt_logprobs is None


def test_n_completions_share_one_output_in_order(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=5, ignore_eos=True)
    [out] = generate(llm, params)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # seed + i: they differ
    [again] = generate(llm, params)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_max_tokens_none_generates_up_to_max_model_len(llm):
    [out] = generate(llm, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 128 - len(PROMPT)
    assert out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="prompt 0: the prompt's 128 tokens fill max_model_len"):
        generate(llm, SamplingParams(max_tokens=None), prompts=([1] * 128,))
    with pytest.raises(ValueError, match="min_tokens=200 is more than the 108 tokens"):
        generate(llm, SamplingParams(max_tokens=None, min_tokens=200))


def test_a_closed_llm_says_so(tiny):
    llm = LLM(model=str(tiny[0]), device="cpu", max_model_len=64)
    llm.close()
    with pytest.raises(RuntimeError, match="engine is closed"):
        generate(llm, GREEDY)


def test_dict_prompts_as_vllm_takes_them_and_other_dicts_refused(llm):
    [plain] = generate(llm, GREEDY)
    [wrapped] = llm.generate({"prompt_token_ids": PROMPT}, GREEDY, use_tqdm=False)
    assert wrapped.outputs[0].token_ids == plain.outputs[0].token_ids
    with pytest.raises(ValueError, match="'prompt'.*'prompt_token_ids'"):
        llm.generate({"a": 1}, GREEDY, use_tqdm=False)


def test_a_tiny_temperature_samples_greedily(llm):
    [greedy] = generate(llm, GREEDY)
    [tiny_t] = generate(llm, SamplingParams(temperature=1e-40, max_tokens=6, ignore_eos=True))
    assert tiny_t.outputs[0].token_ids == greedy.outputs[0].token_ids


@pytest.mark.parametrize("kwargs,field", [
    (dict(ignore_eos="no"), "ignore_eos"),
    (dict(skip_special_tokens=0), "skip_special_tokens"),
    (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output"),
    (dict(stop=5), "stop"),
    (dict(stop=[1]), "stop"),
    (dict(n=0), "n"),
    (dict(min_p=1.5), "min_p"),
    (dict(presence_penalty=3), "presence_penalty"),
    (dict(frequency_penalty="x"), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(logit_bias={"a": 1}), "logit_bias"),
    (dict(logit_bias={1: 1000}), "logit_bias"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(logprobs=21), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(max_tokens=0), "prompt_logprobs"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(seed=2**64), "seed"),
    (dict(stop=["ok", "\udcff"]), "stop string 1 holds a lone UTF-16 surrogate"),
])
def test_every_field_is_checked_by_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_engine_flags_as_vllm_spells_them():
    assert EngineConfig(dtype="half").dtype == "float16"
    assert EngineConfig(dtype="float").dtype == "float32"
    eager = EngineConfig(enforce_eager=True)
    assert (eager.prefill_graph, eager.decode_graph) == ("none", "none")


def test_alltoall_takes_fixed_blocks_up_to_2048_tokens_unless_told():
    def fixed(**kwargs) -> int:
        return EngineConfig(**kwargs).alltoall_fixed_block_tokens

    assert fixed(max_num_seqs=8) == 2048
    assert fixed(max_num_seqs=4096) == 4096  # every decode step
    assert fixed(max_num_seqs=8, ep_fixed_block_tokens=8) == 8
    # without all-to-all the flag does nothing, so it is not checked against max_num_seqs
    assert fixed(max_num_seqs=8, ep_fixed_block_tokens=4) == 4


def test_the_activation_profile_takes_the_largest_fixed_block_step_too():
    from bcg.runner.model_runner import profiled_step_tokens

    alltoall = {"enable_expert_parallel": True, "ep_dispatch": "alltoall"}
    assert profiled_step_tokens(EngineConfig(max_num_batched_tokens=4096)) == [4096]
    assert profiled_step_tokens(EngineConfig(max_num_batched_tokens=4096, **alltoall)) == [
        4096, 2048]
    assert profiled_step_tokens(EngineConfig(max_num_batched_tokens=2048, **alltoall)) == [2048]


def test_none_means_a_fields_default_as_in_vllm(tiny):
    llm = LLM(model=str(tiny[0]), device="cpu", max_model_len=64, max_num_batched_tokens=None,
              block_size=None, seed=None)
    assert llm.engine.config.max_num_batched_tokens == EngineConfig().max_num_batched_tokens
    with pytest.raises(TypeError, match="max_model_length"):
        LLM(model=str(tiny[0]), device="cpu", max_model_length=None)  # a misspelt name
    # the rule holds only while every field that may be None has None as its default
    for f in dataclasses.fields(EngineConfig):
        if "None" in str(f.type):
            assert f.default is None, f.name


def test_enforce_eager_runs(tiny):
    llm = LLM(model=str(tiny[0]), device="cpu", max_model_len=64, enforce_eager=True)
    assert len(generate(llm, GREEDY)[0].outputs[0].token_ids) == 6


def expected_logprobs(hf_model, tokens: list[int]) -> torch.Tensor:
    """Row p: log-softmax of the logits after tokens[: p + 1]."""
    return hf_logits(hf_model, tokens).log_softmax(-1)


def test_logprobs_of_generated_tokens_match_transformers(llm, tiny):
    [out] = generate(llm, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                         logprobs=3))
    completion = out.outputs[0]
    reference = expected_logprobs(tiny[1], PROMPT + completion.token_ids)
    assert len(completion.logprobs) == 5
    total = 0.0
    for step, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs,
                                                  strict=True)):
        row = reference[len(PROMPT) - 1 + step]
        assert list(position)[0] == token and position[token].rank == 1  # greedy: the top
        assert math.isclose(position[token].logprob, row[token].item(), abs_tol=1e-4)
        assert set(position) == set(row.topk(3).indices.tolist())
        total += position[token].logprob
    assert math.isclose(completion.cumulative_logprob, total, abs_tol=1e-6)


@pytest.mark.parametrize("engine_args", [{}, {"max_num_batched_tokens": 7}],
                         ids=["one-chunk", "chunked"])
def test_prompt_logprobs_match_transformers(tiny, engine_args):
    llm = LLM(model=str(tiny[0]), device="cpu", block_size=4, max_model_len=128, **engine_args)
    generate(llm, GREEDY)  # the prompt is now in the prefix cache: scoring must not use it
    params = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=2)
    [out] = generate(llm, params)
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    reference = expected_logprobs(tiny[1], PROMPT)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for p, position in enumerate(out.prompt_logprobs[1:], start=1):
        token = PROMPT[p]
        assert list(position)[0] == token
        assert math.isclose(position[token].logprob, reference[p - 1, token].item(),
                            abs_tol=1e-4)
        assert position[token].rank == int((reference[p - 1] > reference[p - 1, token]).sum()) + 1
        assert len(position) <= 3


def test_logit_bias_forces_a_token(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={7: 100})
    assert generate(llm, params)[0].outputs[0].token_ids == [7, 7, 7, 7]


@pytest.mark.parametrize("penalty", [dict(presence_penalty=2.0), dict(frequency_penalty=2.0),
                                     dict(repetition_penalty=5.0)], ids=lambda p: next(iter(p)))
def test_penalties_reach_the_sampler_and_spread_the_output(llm, penalty):
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    repeats = generate(llm, plain)[0].outputs[0].token_ids
    assert len(set(repeats)) < len(repeats)  # the tiny model repeats itself
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **penalty)
    tokens = generate(llm, params)[0].outputs[0].token_ids
    assert tokens != repeats and len(set(tokens)) >= len(set(repeats))


def test_min_tokens_holds_back_stop_tokens(llm):
    [first] = generate(llm, GREEDY)
    stop = first.outputs[0].token_ids[0]
    params = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop])
    assert generate(llm, params)[0].outputs[0].token_ids == [stop]
    held = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop], min_tokens=3)
    tokens = generate(llm, held)[0].outputs[0].token_ids
    assert len(tokens) >= 3 and stop not in tokens[:3]


def test_min_p_keeps_only_likely_tokens(llm):
    params = SamplingParams(temperature=1.0, min_p=1.0, max_tokens=6, ignore_eos=True, seed=3)
    [greedy] = generate(llm, GREEDY)
    assert generate(llm, params)[0].outputs[0].token_ids == greedy.outputs[0].token_ids


def test_logit_bias_outside_the_vocabulary_is_refused(llm):
    with pytest.raises(ValueError, match="logit_bias names token ids"):
        generate(llm, SamplingParams(max_tokens=2, logit_bias={VOCAB: 1.0}))


def test_a_prompt_of_max_model_len_tokens_can_be_scored(tiny):
    llm = LLM(model=str(tiny[0]), device="cpu", block_size=4, max_model_len=len(PROMPT))
    [out] = generate(llm, SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert len(out.prompt_logprobs) == len(PROMPT) and out.outputs[0].token_ids == []
    with pytest.raises(ValueError, match="plus max_tokens=1 exceed"):
        generate(llm, SamplingParams(max_tokens=1))


def test_an_interrupted_generate_leaves_nothing_queued(llm, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(llm, "_run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        generate(llm, GREEDY)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests()
    assert generate(llm, GREEDY)[0].outputs[0].finish_reason == "length"


def test_sampling_params_are_checked_again_when_generate_takes_them(llm):
    """A None among the params is named, and a field set to a bad value after the params
    were built is refused by name, not met deep in the engine."""
    with pytest.raises(TypeError, match="must hold SamplingParams, got a NoneType"):
        llm.generate([[1, 2], [3, 4]], [SamplingParams(max_tokens=2), None], use_tqdm=False)
    params = SamplingParams(max_tokens=2)
    params.n = 0
    with pytest.raises(ValueError, match="n must be"):
        llm.generate([1, 2, 3], params, use_tqdm=False)


def test_ids_outside_the_vocabulary_name_a_tokenizer_larger_than_the_model(llm, monkeypatch):
    """Text from another model's tokenizer encodes to ids the model lacks: the error says
    which is larger, not only which ids are out."""
    monkeypatch.setattr(llm.engine, "tokenizer", [None] * (VOCAB + 100))
    with pytest.raises(ValueError, match=rf"outside the vocabulary \[0, {VOCAB}\); the tokenizer "
                                         rf"has {VOCAB + 100} tokens, more than the model's"):
        llm.generate([[1, VOCAB + 5]], SamplingParams(max_tokens=1), use_tqdm=False)


def test_numpy_token_ids_are_token_ids(llm):
    """A tokenized dataset's ids (numpy integers) prompt as Python ints do."""
    import numpy

    params = SamplingParams(temperature=0, max_tokens=3)
    [expected] = llm.generate([[1, 2, 3]], params, use_tqdm=False)
    for prompt in (numpy.array([1, 2, 3]).tolist(), list(numpy.array([1, 2, 3]))):
        [got] = llm.generate(prompt, params, use_tqdm=False)
        assert got.prompt_token_ids == [1, 2, 3]
        assert all(type(t) is int for t in got.prompt_token_ids)
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
