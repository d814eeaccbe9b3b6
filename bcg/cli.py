"""`bcg` command line: `bcg generate "prompt"` and `bcg serve [MODEL]`, every engine argument
a flag. `python -m bcg` is the same command.

Errors in what the user passed (a flag, a file) print one line, `bcg: error: ...`, and exit
with status 2; Ctrl-C prints `bcg: interrupted` and exits with status 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import sys
import types
import typing

from bcg.utils import invalid_unicode, one_line

if typing.TYPE_CHECKING:  # the command imports torch only once a command needs it
    from bcg.engine.llm import LLM
    from bcg.engine.sampling_params import SamplingParams

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE
STDIN = "-"
DEFAULT_MAX_TOKENS = 256


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage block), as every other error here."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(EXIT_BAD_INPUT, f"bcg: error: {message} (see `{self.prog} --help`)\n")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per `EngineConfig` field, documented by the field's help."""
    from bcg.config import EngineConfig

    _add_dataclass_args(parser.add_argument_group("engine"), EngineConfig)


def _add_dataclass_args(group, cls: type) -> None:
    """One flag per field of the dataclass `cls`, documented by the field's `help`."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        meta = field.metadata
        flags = (_flag(field.name), *meta.get("aliases", ()))
        help_text = meta["help"].replace("%", "%%")  # argparse %-formats help
        if hints[field.name] in (bool, bool | None):  # None: decided by the device
            group.add_argument(*flags, action=argparse.BooleanOptionalAction,
                               default=field.default, help=help_text + _default_note(field))
            continue
        group.add_argument(*flags, type=_value_type(hints[field.name]), default=field.default,
                           choices=meta.get("choices"), help=help_text + _default_note(field))


def engine_config_from_args(args: argparse.Namespace):
    """The `EngineConfig` of the parsed flags; a bad value raises ValueError naming its flag."""
    from bcg.config import EngineConfig

    names = [f.name for f in dataclasses.fields(EngineConfig)]
    return _naming_flags(names, lambda: EngineConfig(**{n: getattr(args, n) for n in names}))


# generate's float sampling flags: (flag, default, help); SamplingParams checks the values
FLOAT_SAMPLING_FLAGS = (
    ("--temperature", 0.0, "0 is greedy; higher is more random"),
    ("--top-p", 1.0, "sample from the most likely tokens covering this probability, in (0, 1]"),
    ("--min-p", 0.0, "drop tokens less likely than this times the most likely one, in [0, 1]; "
     "0 is off"),
    ("--presence-penalty", 0.0, "subtracted from the logit of every token already generated, "
     "in [-2, 2]; 0 is off"),
    ("--frequency-penalty", 0.0, "subtracted once per earlier occurrence of a token in the "
     "output, in [-2, 2]; 0 is off"),
    ("--repetition-penalty", 1.0, "above 1 makes tokens of the prompt and output less likely, "
     "below 1 more; 1 is off"),
)


def build_parser() -> argparse.ArgumentParser:
    from bcg import __version__

    parser = ArgumentParser(prog="bcg", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=__version__,
                        help="print the version and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate = commands.add_parser(
        "generate", help="generate text for one or more prompts",
        description="Generate a completion (or, with --chat, an assistant reply) per prompt. "
                    "One prompt is streamed as it is generated; several get a progress bar "
                    "and are printed when all are done.",
    )
    generate.add_argument("prompts", nargs="+", metavar="PROMPT",
                          help=f"prompt text; '{STDIN}' reads the prompt from standard input")
    generate.add_argument("--chat", action="store_true",
                          help="treat each prompt as a user message in the chat template")
    generate.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                          help="with --chat: a Jinja chat template (a file, or the template "
                          "itself) instead of the tokenizer's own")
    generate.add_argument("-v", "--verbose", action="store_true", help="log engine progress")
    sampling = generate.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=None,
                          help=f"most new tokens (default: {DEFAULT_MAX_TOKENS}, or what "
                          "--max-model-len leaves after the prompt if that is less)")
    for flag, default, text in FLOAT_SAMPLING_FLAGS:
        sampling.add_argument(flag, type=float, default=default, help=f"{text} ({default:g})")
    sampling.add_argument("--top-k", type=int, default=0,
                          help="sample from the k most likely tokens; 0 or -1 is off (0)")
    sampling.add_argument("--stop", action="append", default=[],
                          help="stop before this string (repeatable)")
    sampling.add_argument("--ignore-eos", action="store_true",
                          help="keep generating past the end-of-sequence token")
    sampling.add_argument("--no-progress", action="store_true",
                          help="hide the progress bar (shown for several prompts)")
    add_engine_args(generate)
    serve = commands.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions and /v1/models (OpenAI's "
                    "API), vLLM's /tokenize, /detokenize, /tokenizer_info and /version, and "
                    "/health and /metrics; every request in flight shares the engine's steps.",
    )
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model to serve, as vLLM takes it: the same as --model")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default: 127.0.0.1, this machine only)")
    serve.add_argument("--port", type=int, default=8000,  # the range: serve's check_port
                       help="port to listen on, 1 to 65535 (default: 8000)")
    serve.add_argument("--served-model-name", default=None,
                       help="the name clients pass as `model`; default: the model as given, or "
                            "the built-in model's name")
    serve.add_argument("-v", "--verbose", action="store_true", help="log engine progress")
    from bcg.server.serve import ServerSettings

    _add_dataclass_args(serve.add_argument_group("server"), ServerSettings)
    add_engine_args(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="%(levelname)s %(name)s: %(message)s")
        if args.command == "serve":
            return _serve(args)
        return _generate(args)
    except KeyboardInterrupt:
        print("bcg: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ValueError, FileNotFoundError) as error:
        print(f"bcg: error: {one_line(error)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # `bcg generate ... | head`: the reader left, nothing to report
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except OSError as error:  # the machine refused (a port in use, a file not readable)
        print(f"bcg: error: {one_line(error)}", file=sys.stderr)
        return EXIT_FAILED
    except RuntimeError as error:
        from bcg.distributed.launcher import TensorParallelError  # torch is loaded by now

        if not isinstance(error, TensorParallelError):
            raise
        print(f"bcg: error: {one_line(error)}", file=sys.stderr)  # it names the rank and why
        return EXIT_FAILED


def _generate(args: argparse.Namespace) -> int:
    from bcg.engine.chat import ChatOptions

    prompts = _read_prompts(args.prompts)
    config = engine_config_from_args(args)  # bad flags fail before the model loads
    params = _sampling_params(args)
    chat = ChatOptions(chat_template=_chat_template(args))
    if config.tokenizer is None and config.model_source().tokenizer_path is None:
        raise ValueError(f"{config.model} has no tokenizer and bcg generate takes text: name "
                         "one with --tokenizer (a Hugging Face folder or id)")
    from bcg.engine.llm import LLM

    llm = LLM(**dataclasses.asdict(config))
    # tokenized here once: the default --max-tokens depends on each prompt's length
    requests = [llm.apply_chat_template([{"role": "user", "content": p}], chat) if args.chat
                else llm.engine.tokenize(p) for p in prompts]
    each = [params if args.max_tokens is not None
            else _default_max_tokens(params, len(ids), llm.engine.max_model_len)
            for ids in requests]
    if len(prompts) == 1:
        return _stream(llm, requests[0], prompts[0], each[0], args.chat)
    outputs = llm.generate(requests, each, use_tqdm=not args.no_progress)
    for prompt, output in zip(prompts, outputs, strict=True):
        print(f"### {prompt}")
        text = output.outputs[0].text
        print(text if args.chat else prompt + text)
    return 0


def _default_max_tokens(params: SamplingParams, prompt_len: int,
                        max_model_len: int) -> SamplingParams:
    """`params` with --max-tokens left out: DEFAULT_MAX_TOKENS, or None (the engine's "up to
    max_model_len") where the prompt leaves less room than that; a prompt that leaves none
    the engine then refuses by its index."""
    fits = prompt_len + DEFAULT_MAX_TOKENS <= max_model_len
    return dataclasses.replace(params, max_tokens=DEFAULT_MAX_TOKENS if fits else None)


def _stream(llm: LLM, token_ids: list[int], prompt: str, params: SamplingParams,
            chat: bool) -> int:
    """Print one prompt's text as it is generated: each engine step's output holds the text
    so far, and the part not yet shown is written."""
    engine = llm.engine
    request_id = engine.add_request(token_ids, params)
    out = sys.stdout
    shown = "" if chat else prompt
    out.write(shown)
    out.flush()
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id == request_id:
                    text = output.outputs[0].text
                    text = text if chat else prompt + text
                    out.write(text[len(shown):])
                    out.flush()
                    shown = text
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        if shown:
            out.write("\n")
            out.flush()
        raise
    out.write("\n")
    out.flush()
    return 0


def _serve(args: argparse.Namespace) -> int:
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"the model is given twice, as MODEL {args.model_tag!r} and as "
                             f"--model {args.model!r}: give one")
        args.model = args.model_tag
    config = engine_config_from_args(args)
    from bcg.server.serve import ServerSettings, serve

    names = [f.name for f in dataclasses.fields(ServerSettings)]
    settings = _naming_flags(names, lambda: ServerSettings(**{n: getattr(args, n) for n in names}))
    serve(config, args.host, args.port, args.served_model_name, settings)
    return 0


def _read_prompts(prompts: list[str]) -> list[str]:
    """The prompts, with '-' read from standard input (once: it has one text), each checked
    to be text a tokenizer can encode before the model loads."""
    if prompts.count(STDIN) > 1:
        raise ValueError(f"the prompt '{STDIN}' (standard input) may be given only once")
    if STDIN in prompts:
        text = sys.stdin.read()
        text = text[:-1] if text.endswith("\n") else text  # `echo ... |` adds one
        if not text.strip():
            raise ValueError("the prompt read from standard input ('-') is empty")
        prompts = [text if p == STDIN else p for p in prompts]
    for index, prompt in enumerate(prompts):
        invalid = invalid_unicode(prompt)
        if invalid is not None:
            raise ValueError(f"prompt {index} {invalid}: pass UTF-8 text")
        if not prompt:
            raise ValueError(f"prompt {index} is empty")
    return prompts


def _sampling_params(args: argparse.Namespace):
    from bcg.engine.sampling_params import SamplingParams

    max_tokens = DEFAULT_MAX_TOKENS if args.max_tokens is None else args.max_tokens
    values = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  min_p=args.min_p, presence_penalty=args.presence_penalty,
                  frequency_penalty=args.frequency_penalty,
                  repetition_penalty=args.repetition_penalty,
                  max_tokens=max_tokens, stop=args.stop, ignore_eos=args.ignore_eos)
    if max_tokens < 1:  # LLM(...) takes 0 with prompt_logprobs, which no flag asks for
        raise ValueError(f"--max-tokens must be at least 1, got {max_tokens}")
    return _naming_flags(list(values), lambda: SamplingParams(**values))


def _chat_template(args: argparse.Namespace) -> str | None:
    """--chat-template's text (`read_chat_template`); it needs --chat."""
    from bcg.engine.chat import read_chat_template

    if args.chat_template is None:
        return None
    if not args.chat:
        raise ValueError("--chat-template applies to chat prompts: add --chat")
    return _naming_flags(["chat_template"], lambda: read_chat_template(args.chat_template))


def _naming_flags(names: list[str], build):
    """`build()`, with a ValueError that opens with a field's name re-worded to its flag
    ("top_p must be ..." -> "--top-p must be ...")."""
    try:
        return build()
    except ValueError as error:
        message = str(error)
        match = re.match(r"\w+", message)
        if match and match.group() in names:
            message = _flag(match.group()) + message[match.end():]
        raise ValueError(message) from None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _value_type(hint) -> typing.Callable[[str], typing.Any]:
    """`int | None` -> int: the flag parses the non-None member; a dict is given as JSON."""
    if isinstance(hint, types.UnionType):
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return _json_object if hint is dict else hint


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, like '{\"num_hidden_layers\": 4}'")
    return value


def _default_note(field: dataclasses.Field) -> str:
    """' (default: X)', unless the help already tells the default."""
    if field.default is None or "default:" in field.metadata["help"].lower():
        return ""
    if isinstance(field.default, bool):
        return f" (default: {'on' if field.default else 'off'})"
    return f" (default: {field.default})"


if __name__ == "__main__":
    sys.exit(main())
