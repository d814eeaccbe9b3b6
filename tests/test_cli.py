import dataclasses
import io
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import bcg
from bcg import cli
from bcg.cli import build_parser, engine_config_from_args, main
from bcg.config import EngineConfig
from tests.builtin_model import require_builtin_model

FAST = ["--device", "cpu", "--max-model-len", "256"]


def run_cli(argv, capsys) -> tuple[int, str, str]:
    """`bcg ARGV` in this process: (exit status, stdout, stderr); argparse's exits count."""
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(err: str, *words: str) -> None:
    assert err.startswith("bcg: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for word in words:
        assert word in err, (word, err)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_flag_is_documented(capsys, command):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    help_text = capsys.readouterr().out
    for field in dataclasses.fields(EngineConfig):
        assert "--" + field.name.replace("_", "-") in help_text
        assert field.metadata["help"]
    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    for action in subparsers.choices[command]._actions:
        assert action.help, action.option_strings or action.dest


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_flag_is_in_the_readme(command):
    readme = (Path(bcg.__file__).parent.parent / "README.md").read_text()
    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    for action in subparsers.choices[command]._actions:
        flag = next((o for o in action.option_strings if o.startswith("--")), None)
        if flag not in (None, "--help"):  # a boolean's --X, which its --no-X follows
            assert flag in readme, f"{command} {flag} is not in README.md"


def test_on_off_flags_show_their_default(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "earlier prompts (default: on)" in help_text  # --enable-prefix-caching
    assert "--prefill-graph none --decode-graph none) (default: off)" in help_text


def test_vllm_flag_names_are_taken_too():
    config = engine_config_from_args(
        build_parser().parse_args(["generate", "hi", "-ep", "--no-async-scheduling"]))
    assert config.enable_expert_parallel and config.overlap is False
    assert build_parser().parse_args(["serve", "--disable-uvicorn-access-log"]).disable_access_log


def test_flags_reach_the_engine_config():
    args = build_parser().parse_args([
        "generate", "hi", "--max-model-len", "512", "--no-enable-prefix-caching",
        "--dtype", "float32", "--kv-cache-tokens", "4096", "--device", "cpu",
    ])
    config = engine_config_from_args(args)
    assert (config.max_model_len, config.enable_prefix_caching, config.dtype) == \
        (512, False, "float32")
    assert config.kv_cache_tokens == 4096 and config.model is None


def test_hf_overrides_is_a_json_object():
    args = build_parser().parse_args(["generate", "hi", "--hf-overrides",
                                      '{"num_hidden_layers": 2, "rope_theta": 1e4}'])
    config = engine_config_from_args(args)
    assert config.hf_overrides == {"num_hidden_layers": 2, "rope_theta": 1e4}


@pytest.mark.parametrize("spelling,dtype", [
    ("half", "float16"), ("float", "float32"), ("float16", "float16"),
    ("bfloat16", "bfloat16"), ("float32", "float32"), ("auto", "auto"),
])
def test_dtype_takes_vllm_spellings(spelling, dtype):
    args = build_parser().parse_args(["generate", "hi", "--dtype", spelling])
    assert engine_config_from_args(args).dtype == dtype


def test_enforce_eager_turns_every_graph_off():
    config = engine_config_from_args(build_parser().parse_args(["generate", "hi",
                                                                "--enforce-eager"]))
    assert config.enforce_eager and (config.prefill_graph, config.decode_graph) == ("none", "none")
    config = engine_config_from_args(build_parser().parse_args(["generate", "hi"]))
    assert not config.enforce_eager and config.prefill_graph == "breakable"


def test_enforce_eager_names_the_graph_modes_it_overrides(caplog):
    with caplog.at_level("WARNING"):
        engine_config_from_args(build_parser().parse_args(
            ["generate", "hi", "--enforce-eager", "--prefill-graph", "piecewise"]))
    assert "enforce_eager overrides prefill_graph='piecewise'" in caplog.text
    assert "decode_graph" not in caplog.text


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == bcg.__version__


def test_python_dash_m_bcg_is_the_command():
    result = subprocess.run([sys.executable, "-m", "bcg", "--version"], capture_output=True,
                            text=True, timeout=120)
    assert (result.returncode, result.stdout.strip()) == (0, bcg.__version__)


@pytest.fixture
def served(monkeypatch):
    """`bcg serve` with the server replaced: what it would have served."""
    import bcg.server.serve

    calls = []
    monkeypatch.setattr(bcg.server.serve, "serve", lambda *args: calls.append(args))
    return calls


def test_serve_takes_the_model_as_vllm_does(served, capsys):
    assert main(["serve", "qwen3-0.6b", "--load-format", "dummy", "--port", "8123"]) == 0
    config, host, port, name, settings = served[-1]
    assert (config.model, config.load_format, host, port, name) == \
        ("qwen3-0.6b", "dummy", "127.0.0.1", 8123, None)
    assert main(["serve", "--model", "qwen3-0.6b", "--max-sequences-per-request", "3"]) == 0
    assert served[-1][0].model == "qwen3-0.6b" and served[-1][4].max_sequences_per_request == 3
    assert main(["serve", "qwen3-0.6b", "--model", "qwen3-0.6b"]) == 0
    code, _, err = run_cli(["serve", "qwen3-0.6b", "--model", "qwen3-8b"], capsys)
    assert code == 2
    assert_one_line_error(err, "qwen3-0.6b", "qwen3-8b", "--model")
    assert len(served) == 3


@pytest.mark.parametrize("port", ["99999", "0", "-1", "http"])
def test_a_port_out_of_range_is_refused(capsys, port):
    code, _, err = run_cli(["serve", "--port", port], capsys)
    assert code == 2
    assert_one_line_error(err, "--port", port)


@pytest.mark.parametrize("name", ["", "  "])
def test_a_blank_served_model_name_is_refused(capsys, name):
    code, _, err = run_cli(["serve", "--served-model-name", name], capsys)
    assert code == 2
    assert_one_line_error(err, "--served-model-name", "blank")


def test_a_busy_port_is_refused_before_the_model_loads(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, _, err = run_cli(["serve", "--port", str(port), "--model", "/nonexistent"], capsys)
    assert code in (1, 2)
    assert_one_line_error(err, str(port))


def test_generate_answers_a_question_with_the_builtin_model(capsys):
    require_builtin_model()
    code = main(["generate", "--chat", "--device", "cpu", "--max-tokens", "12", "--no-progress",
                 "--max-model-len", "256", "What is the capital of France?"])
    assert code == 0
    assert "Paris" in capsys.readouterr().out


@pytest.mark.parametrize("argv,expected", [
    (["--max-model-len", "24", "--ignore-eos", "Hello"], [None]),
    (["--max-model-len", "24", "--ignore-eos", "Hello", "Tell me a long story"], [None, None]),
    (["--max-model-len", "300", "--chat", "Hello"], [256]),
])
def test_the_default_max_tokens_fits_a_small_max_model_len(monkeypatch, capsys, argv,
                                                          expected):
    """Left out, --max-tokens is 256, or the engine's "up to max_model_len" (None) where the
    prompt leaves less room: a max_model_len under 256 still generates."""
    require_builtin_model()
    from bcg.engine.llm_engine import LLMEngine

    asked = []  # max_tokens of each request
    add_request = LLMEngine.add_request

    def recording(self, prompt, params):
        asked.append(params.max_tokens)
        return add_request(self, prompt, params)

    monkeypatch.setattr(LLMEngine, "add_request", recording)
    code = main(["generate", "--device", "cpu", "--no-progress", *argv])
    assert code == 0, capsys.readouterr().err
    assert asked == expected


def test_sampling_flags_reach_the_sampling_params():
    args = build_parser().parse_args([
        "generate", "hi", "--min-p", "0.05", "--presence-penalty", "0.5",
        "--frequency-penalty", "-0.5", "--repetition-penalty", "1.2", "--top-k", "-1"])
    params = cli._sampling_params(args)
    assert (params.min_p, params.presence_penalty, params.frequency_penalty,
            params.repetition_penalty, params.top_k) == (0.05, 0.5, -0.5, 1.2, -1)


@pytest.mark.parametrize("from_file", [True, False])
def test_a_chat_template_renders_the_prompt(monkeypatch, capsys, tmp_path, from_file):
    """--chat-template, a file or the template itself, replaces the tokenizer's template."""
    require_builtin_model()
    from bcg.engine.llm_engine import LLMEngine

    template = "{% for m in messages %}Question: {{ m['content'] }}\nAnswer:{% endfor %}"
    if from_file:
        (tmp_path / "chat.jinja").write_text(template)
        template = str(tmp_path / "chat.jinja")
    prompts = []
    add_request = LLMEngine.add_request

    def recording(self, prompt, params):
        prompts.append(self.tokenizer.decode(prompt))
        return add_request(self, prompt, params)

    monkeypatch.setattr(LLMEngine, "add_request", recording)
    code = main(["generate", "--device", "cpu", "--max-tokens", "1", "--max-model-len", "64",
                 "--chat", "--chat-template", template, "Why?"])
    assert code == 0, capsys.readouterr().err
    assert prompts == ["Question: Why?\nAnswer:"]


class RecordingStdout(io.StringIO):
    """stdout that remembers each write, to see text arrive in pieces."""

    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, text):
        self.writes.append(text)
        return super().write(text)


def test_one_prompt_streams_from_stdin(monkeypatch, capsys):
    """The text arrives token by token, reads '-' from stdin, shows no progress bar, and is
    what LLM.generate returns for the same prompt."""
    require_builtin_model()
    monkeypatch.setattr(sys, "stdin", io.StringIO("The capital of France is\n"))
    out = RecordingStdout()
    monkeypatch.setattr(sys, "stdout", out)
    built = []
    from bcg.engine import llm as llm_module

    class KeptLLM(llm_module.LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(llm_module, "LLM", KeptLLM)
    assert main(["generate", "-", "--max-tokens", "8", *FAST]) == 0
    assert "Generating" not in capsys.readouterr().err
    pieces = [w for w in out.writes if w]
    assert pieces[0] == "The capital of France is" and pieces[-1] == "\n"
    assert len(pieces) >= 5  # the prompt, several tokens' text, the newline
    from bcg.engine.sampling_params import SamplingParams

    [expected] = built[0].generate("The capital of France is",
                                   SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert out.getvalue() == "The capital of France is" + expected.outputs[0].text + "\n"


def test_many_prompts_get_a_progress_bar(capsys):
    require_builtin_model()
    assert main(["generate", "--max-tokens", "2", *FAST, "One", "Two"]) == 0
    captured = capsys.readouterr()
    assert "Generating" in captured.err
    assert captured.out.startswith("### One\nOne") and "### Two\nTwo" in captured.out


@pytest.mark.parametrize("stdin,argv,message", [
    ("hi", ["-", "-"], "only once"),
    ("\n", ["-"], "empty"),
])
def test_bad_stdin_prompts(monkeypatch, capsys, stdin, argv, message):
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code, _, err = run_cli(["generate", *argv], capsys)
    assert code == 2
    assert_one_line_error(err, message)


@pytest.mark.parametrize("argv,message", [
    (["generate", "--model", "no-such-model", "hi"], "unknown model"),
    (["generate", "--temperature", "-1", "hi"], "--temperature"),
    (["generate", "--block-size", "0", "hi"], "--block-size"),
    (["generate", "--max-tokens", "abc", "hi"], "--max-tokens"),
    (["generate", "--max-tokens", "-1", "hi"], "--max-tokens must be at least 1, got -1"),
    (["generate", "hi", ""], "prompt 1 is empty"),
    (["generate", "--seed", str(2**70), "hi"], "--seed must be a 64-bit integer"),
    (["generate", "--stop", "\udcff", "hi"], "--stop string 0 holds a lone UTF-16 surrogate"),
    (["generate", "--max-tokens", "0", "hi"], "--max-tokens must be at least 1"),
    (["generate", "--top-p", "0", "hi"], "--top-p"),
    (["generate", "--temperature", "nan", "hi"], "--temperature"),
    (["generate", "--max-model-len", "0", "hi"], "--max-model-len"),
    (["generate", "--max-num-seqs", "0", "hi"], "--max-num-seqs must be in [1, 65535], got 0"),
    (["generate", "-tp", "0", "hi"], "--tensor-parallel-size must be an integer >= 1, got 0"),
    (["generate", "--gpu-memory-utilization", "0", "hi"], "--gpu-memory-utilization"),
    (["generate", "--top-p", "1.5", "hi"], "--top-p must be in (0, 1], got 1.5"),
    (["generate", "--top-k", "-2", "hi"], "--top-k must be an integer >= 1, or 0 / -1 for off"),
    (["generate", "--ep-fixed-block-tokens", "-1", "hi"],
     "--ep-fixed-block-tokens must be > 0, got -1"),
    (["generate", "--ep-dispatch", "alltoall", "hi"],
     "--ep-dispatch 'alltoall' applies only to expert parallel: add --enable-expert-parallel"),
    (["generate", "--min-p", "2", "hi"], "--min-p must be in [0, 1], got 2.0"),
    (["generate", "--presence-penalty", "3", "hi"],
     "--presence-penalty must be a number in [-2, 2]"),
    (["generate", "--repetition-penalty", "0", "hi"], "--repetition-penalty"),
    (["generate", "--chat-template", "{{ messages }}", "hi"],
     "--chat-template applies to chat prompts: add --chat"),
    (["generate", "--chat", "--chat-template", "missing.jinja", "hi"],
     "--chat-template 'missing.jinja' is neither a file nor a Jinja template"),
    (["serve", "--chat-template", "missing.jinja"],
     "--chat-template 'missing.jinja' is neither a file nor a Jinja template"),
    (["generate", "--kv-cache-tokens", "-5", "hi"], "--kv-cache-tokens"),
    (["generate", "--gpu-memory-utilization", "2", "hi"], "--gpu-memory-utilization"),
    (["generate", "--max-num-seqs", "1.5", "hi"], "--max-num-seqs"),
    (["generate", "--dtype", "int8", "hi"], "--dtype"),
    (["generate", "--prefill-graph-tokens", "a,b", "hi"], "--prefill-graph-tokens"),
    (["generate", "--hf-overrides", "{num_hidden_layers: 2}", "hi"], "--hf-overrides: not JSON"),
    (["generate", "--hf-overrides", "[2]", "hi"], "--hf-overrides: must be a JSON object"),
    (["serve", "--max-request-body-bytes", "0"], "--max-request-body-bytes"),
    (["generate", "--model", "/nonexistent", "hi"], "'/nonexistent' does not exist"),
    (["generate", "--model", "models/missing.gguf", "hi"], "does not exist"),
    (["generate", "--tokenizer", "/missing", "hi"], "'/missing' does not exist"),
    ([], "COMMAND"),
])
def test_bad_input_exits_with_a_one_line_error(capsys, argv, message):
    code, _, err = run_cli(argv, capsys)
    assert code == 2
    assert_one_line_error(err, message)
    assert "Hugging Face Hub" not in err


def test_a_preset_without_a_tokenizer_is_refused_before_its_weights_load(monkeypatch, capsys):
    def load(*args, **kwargs):
        raise AssertionError("the engine started")

    monkeypatch.setattr("bcg.engine.llm.LLM.__init__", load)
    code, _, err = run_cli(["generate", "--model", "qwen3-0.6b", "--load-format", "dummy",
                            "hi"], capsys)
    assert code == 2
    assert_one_line_error(err, "qwen3-0.6b has no tokenizer", "--tokenizer")


@pytest.mark.parametrize("argv,stdin,index", [
    (["generate", "ok", "caf\udce9"], "", 1),  # a byte that is not UTF-8, as argv decodes it
    (["generate", "--chat", "-"], "\udcff\udcfe", 0),
])
def test_a_prompt_that_is_not_utf8_is_refused_before_the_model_loads(monkeypatch, capsys, argv,
                                                                    stdin, index):
    def load(*args, **kwargs):
        raise AssertionError("the engine started")

    monkeypatch.setattr("bcg.engine.llm.LLM.__init__", load)
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code, _, err = run_cli(argv, capsys)
    assert code == 2
    assert_one_line_error(err, f"prompt {index} holds a lone UTF-16 surrogate", "UTF-8 text")


def test_engine_errors_at_start_up_print_one_line(capsys):
    require_builtin_model()
    code, _, err = run_cli(["generate", "--device", "cpu", "--max-model-len", "100000", "hi"],
                           capsys)
    assert code == 2
    assert_one_line_error(err, "max_model_len=100000", "8192")


def test_a_prompt_longer_than_the_limit_is_one_line(capsys):
    require_builtin_model()
    code, _, err = run_cli(["generate", "--max-tokens", "300", *FAST, "hi"], capsys)
    assert code == 2
    assert_one_line_error(err, "max_model_len=256")


@pytest.fixture
def gguf_file(tmp_path):
    """Bad .gguf files, made from the built-in one."""
    data = require_builtin_model().read_bytes()

    def make(name: str, content: bytes):
        path = tmp_path / name
        path.write_bytes(content)
        return path

    return data, make


def test_bad_model_files_are_one_line_errors(tmp_path, capsys, gguf_file):
    from bcg.loader.gguf_reader import GGUFFile

    data, make = gguf_file
    data_start = GGUFFile(require_builtin_model()).tensors[0].offset
    cases = {
        make("header-cut.gguf", data[:5000]): "truncated",
        make("data-cut.gguf", data[:data_start + 4096]): "truncated",
        make("garbage.gguf", data[:24] + bytes(range(256)) * 64): "corrupt",
        make("empty.gguf", b""): "empty",
        make("text.gguf", b"hello, I am not a model"): "not a GGUF file",
    }
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{not json")
    cases[folder / "config.json"] = "not valid JSON"
    for path, message in cases.items():
        model = str(path.parent if path.name == "config.json" else path)
        code, _, err = run_cli(["generate", "--model", model, "--device", "cpu", "hi"], capsys)
        assert code == 2, err
        assert_one_line_error(err, str(path), message)
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    code, _, err = run_cli(["generate", "--model", str(folder), "hi"], capsys)
    assert code == 2
    assert_one_line_error(err, str(folder / "config.json"), "lacks", "num_attention_heads")


def test_ctrl_c_exits_130_quietly(monkeypatch, capsys):
    import bcg.server.serve
    from bcg.engine import llm as llm_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(llm_module, "LLM", interrupted)
    monkeypatch.setattr(bcg.server.serve, "serve", interrupted)
    for argv in (["generate", "hi"], ["serve"]):
        code, _, err = run_cli(argv, capsys)
        assert (code, err) == (130, "bcg: interrupted\n")


def test_a_failed_rank_is_one_line_and_other_runtime_errors_are_not_hidden(monkeypatch, capsys):
    from bcg.distributed.launcher import TensorParallelError
    from bcg.engine import llm as llm_module

    def rank_died(*args, **kwargs):
        raise TensorParallelError("tensor-parallel rank 2 failed: its process exited with "
                                  "code -9")

    monkeypatch.setattr(llm_module, "LLM", rank_died)
    code, _, err = run_cli(["generate", "hi"], capsys)
    assert code == 1
    assert_one_line_error(err, "tensor-parallel rank 2 failed", "code -9")

    def bug(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(llm_module, "LLM", bug)
    with pytest.raises(RuntimeError, match="a bug"):
        run_cli(["generate", "hi"], capsys)


def test_ctrl_c_while_streaming_exits_130_without_a_traceback():
    require_builtin_model()
    process = subprocess.Popen(
        [sys.executable, "-m", "bcg", "generate", "--max-tokens", "200", "--ignore-eos",
         *FAST, "Once upon a time"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.read(len("Once upon a time") + 3).startswith("Once upon a time")
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130, err
    assert err.strip().splitlines()[-1] == "bcg: interrupted" and "Traceback" not in err
    assert out.endswith("\n")


def test_a_closed_pipe_is_not_an_error(monkeypatch):
    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError

        def fileno(self):
            raise io.UnsupportedOperation

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    monkeypatch.setattr(cli, "_generate", lambda args: print("text"))
    assert main(["generate", "hi"]) == cli.EXIT_BROKEN_PIPE
