import dataclasses

import pytest
import torch

from bcg.loader.gguf_file import hf_tensor_name, read_gguf_config, unpermute_rope_rows
from bcg.loader.gguf_reader import GGUFFile
from bcg.models.config import ModelConfig
from bcg.models.presets import PRESETS
from tests.builtin_model import require_builtin_model


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's convert_hf_to_gguf does to Llama q/k rows (pairs rotary halves)."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


@pytest.mark.parametrize("num_heads,shape", [(4, (32, 6)), (2, (16, 3)), (3, (24,))])
def test_unpermute_inverts_llama_cpp(num_heads, shape):
    weight = torch.randn(shape)
    assert torch.equal(unpermute_rope_rows(llama_cpp_permute(weight, num_heads), num_heads), weight)


def test_tensor_names_map_to_hugging_face():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.12.ffn_norm.weight") == \
        "model.layers.12.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    with pytest.raises(ValueError, match="no counterpart"):
        hf_tensor_name("blk.0.ssm_conv1d.weight")


def test_builtin_gguf_config_matches_the_smollm2_preset():
    config = ModelConfig.from_hf_dict(read_gguf_config(GGUFFile(require_builtin_model())))
    preset = ModelConfig.from_hf_dict(PRESETS["smollm2-135m"])
    assert config.rms_norm_eps == pytest.approx(preset.rms_norm_eps)  # GGUF stores float32
    assert dataclasses.replace(config, rms_norm_eps=preset.rms_norm_eps) == preset


def test_our_reader_agrees_with_the_gguf_package():
    """Metadata equal; tensors equal after dequantisation (one per kind in the file)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = require_builtin_model()
    ours, theirs = GGUFFile(path), GGUFReader(str(path))
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):  # the reader's own header pseudo-fields
            assert ours.metadata[key] == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    seen = set()
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        if ref.tensor_type not in seen:
            seen.add(ref.tensor_type)
            expected = dequantize(ref.data, ref.tensor_type)
            assert torch.equal(torch.from_numpy(ours.dequantized(mine)),
                               torch.from_numpy(expected.copy())), mine.name
    assert len(seen) == 3  # F32, Q4_1, Q8_0


def test_not_a_gguf_file_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(path)
