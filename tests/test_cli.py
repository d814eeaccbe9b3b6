import dataclasses

import pytest

from bcg.cli import build_parser, engine_config_from_args, main
from bcg.config import EngineConfig
from tests.builtin_model import require_builtin_model


def test_every_engine_argument_is_a_documented_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    help_text = capsys.readouterr().out
    for field in dataclasses.fields(EngineConfig):
        assert "--" + field.name.replace("_", "-") in help_text
        assert field.metadata["help"]


def test_flags_reach_the_engine_config():
    args = build_parser().parse_args([
        "generate", "hi", "--max-model-len", "512", "--no-enable-prefix-caching",
        "--dtype", "float32", "--kv-cache-tokens", "4096", "--device", "cpu",
    ])
    config = engine_config_from_args(args)
    assert (config.max_model_len, config.enable_prefix_caching, config.dtype) == \
        (512, False, "float32")
    assert config.kv_cache_tokens == 4096 and config.model is None


def test_generate_answers_a_question_with_the_builtin_model(capsys):
    require_builtin_model()
    code = main(["generate", "--chat", "--device", "cpu", "--max-tokens", "12", "--no-progress",
                 "--max-model-len", "256", "What is the capital of France?"])
    assert code == 0
    assert "Paris" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["generate", "--model", "no-such-model", "hi"], "unknown model"),
    (["generate", "--temperature", "-1", "hi"], "temperature"),
    (["generate", "--block-size", "0", "hi"], "block_size"),
])
def test_bad_input_exits_with_a_clear_message(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
