"""Bad model files and names: each is a ValueError that names the file (or the name), raised
by the loader before any weights load."""

import os
import struct

import pytest
import torch

from bcg.distributed.parallel_state import TensorParallel
from bcg.layers import linear
from bcg.loader.gguf_file import read_gguf_config
from bcg.loader.gguf_reader import GGUFFile
from bcg.loader.model_loader import load_model
from bcg.loader.model_source import is_hub_id, looks_like_path, resolve_model
from bcg.loader.tokenizer import load_tokenizer
from tests.builtin_model import require_builtin_model
from tests.gguf_files import write_gguf
from tests.hf_tiny import save_tiny_model

LLAMA_METADATA = {
    "llama.attention.head_count": 4,
    "llama.embedding_length": 64,
    "llama.feed_forward_length": 96,
    "llama.block_count": 1,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.context_length": 128,
    "tokenizer.ggml.tokens": [f"t{i}" for i in range(16)],
}


def test_a_written_gguf_reads_back(tmp_path):
    path = write_gguf(tmp_path / "ok.gguf", LLAMA_METADATA)
    config = read_gguf_config(GGUFFile(path))
    assert (config["hidden_size"], config["vocab_size"], config["num_key_value_heads"]) == \
        (64, 16, 4)


@pytest.mark.parametrize("change,message", [
    (lambda m: m.pop("llama.block_count"), "lacks 'llama.block_count'"),
    (lambda m: m.update({"llama.block_count": "many"}), "'llama.block_count' is 'many'"),
    (lambda m: m.update({"tokenizer.ggml.tokens": 7}), "tokenizer.ggml.tokens"),
])
def test_gguf_metadata_problems_name_the_file_and_key(tmp_path, change, message):
    metadata = dict(LLAMA_METADATA)
    change(metadata)
    path = write_gguf(tmp_path / "bad.gguf", metadata)
    with pytest.raises(ValueError, match=message) as error:
        read_gguf_config(GGUFFile(path))
    assert str(path) in str(error.value)


def test_unsupported_gguf_architecture_names_the_file(tmp_path):
    path = write_gguf(tmp_path / "mamba.gguf", {}, arch="mamba")
    with pytest.raises(ValueError, match="architecture 'mamba' is not supported") as error:
        resolve_model(str(path))
    assert str(path) in str(error.value)


def gguf_header(version=3, num_tensors=0, num_values=0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, num_tensors, num_values)


def kv_string(key: str, value: str) -> bytes:
    return (struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", 8)
            + struct.pack("<Q", len(value)) + value.encode())


@pytest.mark.parametrize("content,message", [
    (b"", "is empty"),
    (b"GGU", "not a GGUF file"),
    (b"GGUF\x03\x00", "truncated"),
    (gguf_header(version=1), "version 1 is too old"),
    (gguf_header(version=99), "version 99 is newer"),
    (gguf_header(num_values=1) + struct.pack("<Q", 2**62), "truncated or corrupt"),
    (gguf_header(num_values=2**40), "truncated or corrupt"),
    (gguf_header(num_values=1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 77),
     "unknown value type 77"),
    (gguf_header(num_values=1) + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 8, 2**50),
     "truncated or corrupt"),
    (gguf_header(num_tensors=1, num_values=1) + kv_string("general.architecture", "llama")
     + struct.pack("<Q", 1) + b"w" + struct.pack("<I", 2) + struct.pack("<QQ", 4, 4)
     + struct.pack("<IQ", 0, 0), "ends at byte"),
    (gguf_header(num_tensors=1) + struct.pack("<Q", 1) + b"w" + struct.pack("<I", 1)
     + struct.pack("<Q", 4) + struct.pack("<IQ", 999, 0), "unknown GGML type 999"),
    (gguf_header(num_tensors=1) + struct.pack("<Q", 1) + b"w" + struct.pack("<I", 0)
     + struct.pack("<IQ", 0, 0), "0 dimensions"),
])
def test_corrupt_gguf_files_are_refused_at_open(tmp_path, content, message):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message) as error:
        GGUFFile(path)
    assert str(path) in str(error.value)


def test_a_gguf_cut_short_in_its_weights_is_refused_at_open(tmp_path):
    builtin = require_builtin_model()
    last = max(GGUFFile(builtin).tensors, key=lambda t: t.offset)
    path = tmp_path / "cut.gguf"
    with open(builtin, "rb") as source:
        path.write_bytes(source.read(last.offset + last.num_bytes - 1))
    with pytest.raises(ValueError, match=f"{last.name}.*ends at byte.*incomplete download"):
        GGUFFile(path)


def test_a_directory_or_unreadable_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        GGUFFile(tmp_path)


@pytest.mark.parametrize("text,message", [
    ("{not json", "config.json is not valid JSON"),
    ("[1, 2]", "config.json must hold a JSON object"),
    ('{"architectures": ["LlamaForCausalLM"]}', "config.json lacks 'num_attention_heads'"),
    ('{"architectures": ["MambaForCausalLM"], "num_attention_heads": 4, "vocab_size": 8, '
     '"hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1}',
     "'MambaForCausalLM' is not supported"),
    ('{"architectures": ["LlamaForCausalLM"], "num_attention_heads": "four", "vocab_size": 8, '
     '"hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1}', "config.json"),
    ('{"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4, "vocab_size": 0, '
     '"hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1}',
     "vocab_size must be a positive integer"),
])
def test_bad_config_json_names_the_file(tmp_path, text, message):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=message) as error:
        resolve_model(str(tmp_path))
    assert str(tmp_path / "config.json") in str(error.value)


def test_bad_generation_config_and_weights_name_the_file(tmp_path):
    save_tiny_model("llama", tmp_path)
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        resolve_model(str(tmp_path))
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": "two"}')
    with pytest.raises(ValueError, match="eos_token_id must be a token id"):
        resolve_model(str(tmp_path))
    (tmp_path / "generation_config.json").unlink()
    [weights] = tmp_path.glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[:1000])
    source = resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="not a valid safetensors file") as error:
        load_model(source, torch.float32, torch.device("cpu"))
    assert str(weights) in str(error.value)


@pytest.mark.parametrize("name,hub", [
    ("Qwen/Qwen3-0.6B", True), ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
    ("org/name.v2", True), ("/abs/model", False), ("./org/name", False), ("a/b/c", False),
    ("model.gguf", False), ("org/model.gguf", False), ("~/models", False), ("name", False),
    ("org/../x", False),
])
def test_only_org_name_shapes_are_hub_ids(name, hub):
    assert is_hub_id(name) == hub
    if not hub and name != "name":
        assert looks_like_path(name)


@pytest.mark.parametrize("name", ["/nonexistent", "/no/such/model", "./missing", "a/b/c",
                                  "missing.gguf", "~/no-such-folder-here"])
def test_a_missing_path_is_reported_as_a_path_not_a_hub_id(name):
    with pytest.raises(ValueError, match=f"model path '{name}' does not exist"):
        resolve_model(name)


def test_a_file_that_is_not_a_model_is_refused(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(ValueError, match="is a file but not a GGUF file"):
        resolve_model(str(path))


def test_a_gguf_without_the_suffix_is_recognised(tmp_path):
    link = tmp_path / "smollm2"
    os.symlink(require_builtin_model(), link)
    assert resolve_model(str(link)).config.architecture == "LlamaForCausalLM"


def test_tokenizer_paths_are_checked(tmp_path):
    source = resolve_model("smollm2-135m")
    with pytest.raises(ValueError, match="tokenizer path '/missing' does not exist"):
        load_tokenizer(source, "/missing")
    with pytest.raises(ValueError, match="has none of tokenizer.json"):
        load_tokenizer(source, str(tmp_path))
    (tmp_path / "vocab.txt").write_text("a")
    with pytest.raises(ValueError, match="is a file"):
        load_tokenizer(source, str(tmp_path / "vocab.txt"))
    (tmp_path / "tokenizer_config.json").write_text("{broken")
    with pytest.raises(ValueError, match=f"could not load tokenizer '{tmp_path}'"):
        load_tokenizer(source, str(tmp_path))


@pytest.mark.parametrize("trust", [False, True])
def test_trust_remote_code_reaches_transformers(tmp_path, monkeypatch, trust):
    import bcg.loader.tokenizer as tokenizer_module

    calls = []
    monkeypatch.setattr(tokenizer_module.AutoTokenizer, "from_pretrained",
                        lambda name, **kwargs: calls.append((name, kwargs)) or "tokenizer")
    (tmp_path / "tokenizer.json").write_text("{}")
    source = resolve_model("smollm2-135m")
    for name in (str(tmp_path), "org/name"):  # a folder, a Hub id
        assert load_tokenizer(source, name, trust_remote_code=trust) == "tokenizer"
    assert calls == [(name, {"trust_remote_code": trust}) for name in (str(tmp_path), "org/name")]


def test_a_gguf_tokenizer_without_the_suffix_is_recognised(tmp_path, monkeypatch):
    """The tokenizer override is classified as the model is: a GGUF by its magic bytes too."""
    import bcg.loader.tokenizer as tokenizer_module
    from bcg.loader.gguf_reader import GGUF_MAGIC
    from bcg.loader.model_source import classify_name

    path = tmp_path / "vocab"
    path.write_bytes(GGUF_MAGIC + b"\0" * 16)
    assert classify_name(str(path), "tokenizer") == ("gguf", path)
    loaded = []
    monkeypatch.setattr(tokenizer_module, "_gguf_tokenizer", loaded.append)
    load_tokenizer(resolve_model("smollm2-135m"), str(path))
    assert loaded == [path]
    assert [classify_name(name, "tokenizer")[0] for name in
            (str(tmp_path), "Qwen/Qwen3-0.6B", "name")] == ["folder", "hub", "unknown"]
    with pytest.raises(ValueError, match="tokenizer path '/missing' does not exist"):
        classify_name("/missing", "tokenizer")


def test_library_errors_are_quoted_on_one_line(tmp_path, monkeypatch):
    import bcg.loader.tokenizer as tokenizer_module
    from bcg.utils import one_line

    assert one_line(ValueError("Error:\n  the file\n\n is bad ")) == "Error: the file is bad"
    assert one_line(OSError()) == "OSError"
    assert one_line(ValueError("x" * 400), 300) == "x" * 297 + "..."

    def fails(*args, **kwargs):
        raise OSError("Can't load tokenizer:\n" + "details " * 100)

    monkeypatch.setattr(tokenizer_module.AutoTokenizer, "from_pretrained", fails)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError) as error:
        load_tokenizer(resolve_model("smollm2-135m"), str(tmp_path))
    message = str(error.value)
    assert "\n" not in message and "Can't load tokenizer: details" in message
    assert message.endswith("...") and len(message) < 400


def test_a_split_weight_of_the_wrong_rows_is_refused_by_name(monkeypatch):
    """At tp 2 a checkpoint tensor already split (its rank's rows) matches the parameter's
    shape but not the unsplit blocks: refused, not copied and then cut."""
    monkeypatch.setattr(linear, "tensor_parallel", lambda: TensorParallel(0, 2))
    target = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"'mixer.D' has shape \(2, 3\), the model expects "
                                         r"\(4, 3\)"):
        linear.load_rank_blocks("mixer.D", target, torch.ones(2, 3), [4])
    assert not target.any()
    linear.load_rank_blocks("mixer.D", target, torch.arange(12.0).view(4, 3), [4])
    assert target.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
