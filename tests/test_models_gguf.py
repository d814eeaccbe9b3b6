"""The built-in model (SmolLM2-135M-Instruct GGUF): our greedy output equals transformers'."""

import pytest
import torch

from bcg.engine.llm import LLM
from bcg.engine.sampling_params import SamplingParams
from tests.builtin_model import QUESTIONS, require_builtin_model


@pytest.fixture(scope="module")
def gguf_path():
    return require_builtin_model()


def hf_greedy_from_gguf(gguf_path, prompts: list[list[int]], device: str) -> list[list[int]]:
    """transformers' own GGUF reading (config, name mapping, Q/K un-permutation); assembled by
    hand because `from_pretrained(gguf_file=...)` insists on the `accelerate` package."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    model.load_state_dict(tensors["tensors"], strict=False)
    model.tie_weights()
    model = model.to(device).eval()
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                                 do_sample=False)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def our_greedy(device: str, dtype: str) -> tuple[list[list[int]], list[list[int]]]:
    llm = LLM(device=device, dtype=dtype)
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outputs]


def test_greedy_matches_transformers_cpu(gguf_path):
    prompts, ours = our_greedy("cpu", "float32")
    assert ours == hf_greedy_from_gguf(gguf_path, prompts, "cpu")


@pytest.mark.gpu
def test_greedy_matches_transformers_cuda_fp32(gguf_path):
    """Exact on the CPU; on CUDA the Triton attention's TF32 dots could, rarely, flip a
    near-tie late in a reply: a failure here names that token, look at its logit gap."""
    prompts, ours = our_greedy("cuda", "float32")
    assert ours == hf_greedy_from_gguf(gguf_path, prompts, "cuda")


@pytest.mark.gpu
def test_greedy_bf16_cuda_starts_like_fp32(gguf_path):
    """bf16 rounding may flip a near-tie late in a reply; the first 8 tokens must agree."""
    _, fp32 = our_greedy("cuda", "float32")
    _, bf16 = our_greedy("cuda", "bfloat16")
    assert [t[:8] for t in bf16] == [t[:8] for t in fp32]
