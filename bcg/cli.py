"""`bcg` command line: `bcg generate "prompt"` and `bcg serve`, every engine argument a flag."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import types
import typing

from bcg.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per `EngineConfig` field, documented by the field's help."""
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        meta = field.metadata
        if hints[field.name] is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default,
                               help=meta["help"])
            continue
        group.add_argument(flag, type=_value_type(hints[field.name]), default=field.default,
                           choices=meta.get("choices"), help=meta["help"] + _default_note(field))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bcg", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser(
        "generate", help="generate text for one or more prompts",
        description="Generate a completion (or, with --chat, an assistant reply) per prompt.",
    )
    generate.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text")
    generate.add_argument("--chat", action="store_true",
                          help="treat each prompt as a user message in the chat template")
    generate.add_argument("-v", "--verbose", action="store_true", help="log engine progress")
    sampling = generate.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=256, help="most new tokens (256)")
    sampling.add_argument("--temperature", type=float, default=0.0,
                          help="0 is greedy (the default); higher is more random")
    sampling.add_argument("--top-p", type=float, default=1.0,
                          help="sample from the most likely tokens covering this probability (1)")
    sampling.add_argument("--top-k", type=int, default=0,
                          help="sample from the k most likely tokens; 0 is off (0)")
    sampling.add_argument("--stop", action="append", default=[],
                          help="stop before this string (repeatable)")
    sampling.add_argument("--ignore-eos", action="store_true",
                          help="keep generating past the end-of-sequence token")
    sampling.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_engine_args(generate)
    serve = commands.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and "
                    "/metrics; every request in flight shares the engine's steps.",
    )
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default: 127.0.0.1, this machine only)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    serve.add_argument("--served-model-name", default=None,
                       help="the name clients pass as `model`; default: --model as given, or "
                            "the built-in model's name")
    serve.add_argument("-v", "--verbose", action="store_true", help="log engine progress")
    add_engine_args(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return _serve(args) if args.command == "serve" else _generate(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"bcg: error: {error}", file=sys.stderr)
        return 2


def _generate(args: argparse.Namespace) -> int:
    from bcg.engine.llm import LLM
    from bcg.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, stop=args.stop,
                            ignore_eos=args.ignore_eos)
    config = engine_config_from_args(args)
    llm = LLM(**dataclasses.asdict(config))
    use_tqdm = not args.no_progress
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in args.prompts]
        outputs = llm.chat(conversations, params, use_tqdm=use_tqdm)
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=use_tqdm)
    for prompt, output in zip(args.prompts, outputs, strict=True):
        if len(outputs) > 1:
            print(f"### {prompt}")
        text = output.outputs[0].text
        print(text if args.chat else prompt + text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from bcg.server.serve import serve

    serve(engine_config_from_args(args), args.host, args.port, args.served_model_name)
    return 0


def _value_type(hint) -> type:
    """`int | None` -> int: the flag parses the non-None member."""
    if isinstance(hint, types.UnionType):
        return next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


def _default_note(field: dataclasses.Field) -> str:
    return "" if field.default is None else f" (default: {field.default})"


if __name__ == "__main__":
    sys.exit(main())
