"""Qwen3-MoE end to end on a tiny random model against transformers (greedy tokens through
the engine, whole and chunked prefill), its config, presets and weight loading (safetensors
folders and GGUF's stacked experts). Its logits
are compared with transformers' in test_models_hf.py, the split model in
test_tensor_parallel.py, the kernel in test_kernels_fused_moe.py."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from bcg.engine.llm import LLM
from bcg.engine.sampling_params import SamplingParams
from bcg.layers.fused_moe import FusedMoE, select_experts
from bcg.loader.model_loader import load_model
from bcg.loader.model_source import resolve_model
from bcg.models.config import ModelConfig
from bcg.models.presets import PRESETS
from bcg.models.qwen3_moe import Qwen3MoeSparseMoeBlock
from bcg.models.registry import model_class
from tests.gguf_files import write_gguf
from tests.hf_tiny import VOCAB, PagedHarness, save_tiny_model_and_greedy
from tests.numerics import relative_error

PROMPTS = [[(5 * i + 3 * j) % VOCAB for j in range(n)] for i, n in enumerate((4, 11, 23))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_moe")
    return save_tiny_model_and_greedy("qwen3_moe", folder, PROMPTS, GREEDY.max_tokens)


@pytest.mark.parametrize("renormalize", [True, False])
def test_router_matches_transformers(renormalize):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3,
                            norm_topk_prob=renormalize)
    router = Qwen3MoeTopKRouter(config)
    generator = torch.Generator().manual_seed(0)
    router.weight.data = torch.randn(8, 16, generator=generator)
    hidden = torch.randn(5, 16, generator=generator)
    _, hf_weights, hf_ids = router(hidden)
    weights, ids = select_experts(hidden @ router.weight.T, 3, renormalize)
    assert torch.equal(ids.long(), hf_ids) and torch.allclose(weights, hf_weights)


@pytest.mark.parametrize("chunk", [2048, 5])
def test_greedy_matches_transformers(tiny, chunk):
    folder, expected = tiny
    llm = LLM(model=str(folder), device="cpu", block_size=4, max_model_len=64,
              max_num_batched_tokens=chunk)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_dense_and_sparse_layers_follow_the_config(tiny):
    model = load_model(resolve_model(str(tiny[0])), torch.float32, torch.device("cpu"))
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["Qwen3MoeSparseMoeBlock", "LlamaMLP", "Qwen3MoeSparseMoeBlock"]
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (4, 64, 64) and experts.down_proj.shape == (4, 64, 32)


def test_experts_are_stacked_gate_then_up(tiny):
    folder = tiny[0]
    model = load_model(resolve_model(str(folder)), torch.float32, torch.device("cpu"))
    weights = load_file(folder / "model.safetensors")
    experts = model.model.layers[2].mlp.experts
    prefix = "model.layers.2.mlp.experts.3"
    assert torch.equal(experts.gate_up_proj[3, :32], weights[f"{prefix}.gate_proj.weight"])
    assert torch.equal(experts.gate_up_proj[3, 32:], weights[f"{prefix}.up_proj.weight"])
    assert torch.equal(experts.down_proj[3], weights[f"{prefix}.down_proj.weight"])


def test_a_missing_expert_is_named(tiny, tmp_path):
    folder = tiny[0]
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.2.mlp.experts.1.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ValueError, match=r"lacks 1 weights: model.layers.2.mlp.experts.1.up_"):
        load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"))


def test_experts_of_a_dense_layer_are_refused(tiny):
    source = resolve_model(str(tiny[0]))
    source.config.mlp_only_layers = [1, 2]
    with pytest.raises(ValueError, match="layers.2.mlp.experts is not a sparse layer's"):
        load_model(source, torch.float32, torch.device("cpu"))


def test_config_fields_and_their_errors(tiny, tmp_path):
    config = resolve_model(str(tiny[0])).config
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.norm_topk_prob, config.mlp_only_layers) == (4, 2, 32, True, [1])
    assert [config.is_sparse_layer(i) for i in range(3)] == [True, False, True]
    config.mlp_only_layers, config.decoder_sparse_step = [], 2
    assert [config.is_sparse_layer(i) for i in range(4)] == [False, True, False, True]
    bad = (tiny[0] / "config.json").read_text().replace('"num_experts_per_tok": 2',
                                                        '"num_experts_per_tok": 5')
    (tmp_path / "config.json").write_text(bad)
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(5\) exceeds num_experts \(4\)"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("name,layers,experts_shape", [
    ("qwen3-30b-a3b", 48, (128, 1536, 2048)),
    ("qwen3-235b-a22b", 94, (128, 3072, 4096)),
])
def test_presets_have_the_published_shapes(name, layers, experts_shape):
    config = ModelConfig.from_hf_dict(PRESETS[name])
    assert model_class(config.architecture).__name__ == "Qwen3MoeForCausalLM"
    assert config.num_hidden_layers == layers and config.num_experts_per_tok == 8
    assert config.norm_topk_prob and all(map(config.is_sparse_layer, range(layers)))
    with torch.device("meta"):
        block = Qwen3MoeSparseMoeBlock(config)
    assert isinstance(block.experts, FusedMoE)
    assert tuple(block.experts.gate_up_proj.shape) == experts_shape


# Hugging Face -> llama.cpp names of the tensors of one layer (convert_hf_to_gguf's).
GGUF_LAYER_PARTS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
GGUF_GLOBALS = {"model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def write_moe_gguf(folder, path):
    """The folder's model as llama.cpp writes a Qwen3-MoE: each layer's experts stacked."""
    hf = json.loads((folder / "config.json").read_text())
    tensors, experts = {}, {}
    for name, weight in load_file(folder / "model.safetensors").items():
        if name in GGUF_GLOBALS:
            tensors[GGUF_GLOBALS[name]] = weight.numpy()
            continue
        layer, part = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name).groups()
        expert = re.fullmatch(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj", part)
        if expert:
            experts.setdefault((layer, expert[2]), {})[int(expert[1])] = weight
        else:
            tensors[f"blk.{layer}.{GGUF_LAYER_PARTS[part]}.weight"] = weight.numpy()
    for (layer, projection), weights in experts.items():
        stacked = torch.stack([weights[e] for e in sorted(weights)])
        tensors[f"blk.{layer}.ffn_{projection}_exps.weight"] = stacked.numpy()
    metadata = {
        "qwen3moe.attention.head_count": hf["num_attention_heads"],
        "qwen3moe.attention.head_count_kv": hf["num_key_value_heads"],
        "qwen3moe.attention.key_length": hf["head_dim"],
        "qwen3moe.embedding_length": hf["hidden_size"],
        "qwen3moe.feed_forward_length": hf["intermediate_size"],
        "qwen3moe.block_count": hf["num_hidden_layers"],
        "qwen3moe.attention.layer_norm_rms_epsilon": hf["rms_norm_eps"],
        "qwen3moe.context_length": hf["max_position_embeddings"],
        "qwen3moe.rope.freq_base": hf["rope_parameters"]["rope_theta"],
        "qwen3moe.expert_count": hf["num_local_experts"],
        "qwen3moe.expert_used_count": hf["num_experts_per_tok"],
        "qwen3moe.expert_feed_forward_length": hf["moe_intermediate_size"],
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(hf["vocab_size"])],
    }
    return write_gguf(path, metadata, arch="qwen3moe", tensors=tensors)


def test_gguf_with_stacked_experts_gives_the_folders_logits(tiny, tmp_path):
    folder = tiny[0]
    path = write_moe_gguf(folder, tmp_path / "moe.gguf")
    config = resolve_model(str(path)).config
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.norm_topk_prob, config.mlp_only_layers) == (4, 2, 32, True, [1])
    logits = []
    for model in (folder, path):
        harness = PagedHarness(model)
        seq = harness.new_sequence(PROMPTS[2])
        logits.append(harness.step([seq], [seq.num_tokens])[0])
    assert relative_error(logits[1], logits[0]) <= 1e-5  # the GGUF's eps is float32
