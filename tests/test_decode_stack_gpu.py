"""The fused decode stack (every layer of a one-sequence decode step in one launch) against
the layers run one by one, on random Llama and Qwen3 models in bf16 on CUDA: the tiny test
models, a Qwen3 of qwen3-0.6b's layer sizes and a Llama of SmolLM2-135M's (two layers each),
whose projections cut into several chunks a program. Each case prefills a prompt, then decodes
several steps, so the keys and values the kernel stored feed the steps after it; eager steps
and full decode graphs.
"""

from functools import cache

import pytest
import torch

import bcg.layers.decode_stack as decode_stack_layer
from tests.hf_tiny import VOCAB, PagedHarness, save_tiny_model
from tests.numerics import relative_error

pytestmark = pytest.mark.gpu

TOLERANCE = 3e-2  # bf16's rounding, summed in another order (as test_graph_runners_gpu)
MODELS = {
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),
    "qwen3-0.6b-layers": ("qwen3", dict(hidden_size=1024, intermediate_size=3072,
                                        num_attention_heads=16, num_key_value_heads=8,
                                        head_dim=128)),
    # SmolLM2-135M's (the built-in model): groups of three query heads, head_dim 64
    "smollm2-layers": ("llama", dict(hidden_size=576, intermediate_size=1536,
                                     num_attention_heads=9, num_key_value_heads=3, head_dim=64)),
}
MODES = {"eager": dict(prefill_graph="none", decode_graph="none"),
         "full graph": dict(prefill_graph="breakable", decode_graph="full")}


@cache
def folder(model: str, tmp_root: str):
    arch, overrides = MODELS[model]
    path = f"{tmp_root}/{model}"
    save_tiny_model(arch, path, max_position_embeddings=2048, **overrides)
    return path


def harness(monkeypatch, path: str, mode: str, fused: bool) -> PagedHarness:
    monkeypatch.setattr(decode_stack_layer, "SWITCHED_ON", fused)
    return PagedHarness(path, device="cuda", dtype="bfloat16", block_size=16, max_model_len=2048,
                        kv_cache_tokens=8192, max_num_seqs=4, enable_prefix_caching=False,
                        **MODES[mode])


def decode_logits(h: PagedHarness, prompt_len: int, steps: int) -> list[torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (prompt_len + steps,),
                           generator=torch.Generator().manual_seed(prompt_len)).tolist()
    seq = h.new_sequence(tokens)
    h.step([seq], [prompt_len])
    logits = [h.step([seq], [1])[0] for _ in range(steps)]
    h.block_manager.free(seq)
    return [row.float().cpu() for row in logits]


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("mode", list(MODES))
def test_fused_decode_steps_equal_the_layers(monkeypatch, tmp_path_factory, model, mode):
    path = folder(model, str(tmp_path_factory.getbasetemp()))
    calls = []
    launch = decode_stack_layer.triton_ops.decode_stack
    monkeypatch.setattr(decode_stack_layer.triton_ops, "decode_stack",
                        lambda *args: calls.append(1) or launch(*args))
    layered = harness(monkeypatch, path, mode, fused=False)
    expected = {n: decode_logits(layered, n, steps=4) for n in (5, 300, 1500)}
    assert not calls
    fused = harness(monkeypatch, path, mode, fused=True)
    for prompt_len, rows in expected.items():
        for got, want in zip(decode_logits(fused, prompt_len, steps=4), rows, strict=True):
            assert relative_error(got, want) <= TOLERANCE, (prompt_len, relative_error(got, want))
    assert calls  # the fused kernel ran (in a graph: at its capture)

