"""`LLM`: offline batch generation and chat over one `LLMEngine`."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from bcg.config import EngineConfig
from bcg.engine.chat import DEFAULT_CHAT, ChatOptions, read_chat_template
from bcg.engine.llm_engine import LLMEngine, check_one_per_prompt
from bcg.engine.outputs import RequestOutput
from bcg.engine.sampling_params import SamplingParams
from bcg.utils import is_token_id

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Prompt = str | list[int]
Message = Mapping[str, Any]  # {'role': ..., 'content': a string or text parts}

logger = logging.getLogger(__name__)


class LLM:
    """`LLM(model=..., **engine_args)`; the arguments are the fields of `EngineConfig`, None
    meaning a field's default (as vLLM's `LLM` takes it; every field that may be None has
    None as its default)."""

    def __init__(self, model: str | None = None, **engine_args) -> None:
        names = {f.name for f in fields(EngineConfig)}
        given = {name: value for name, value in engine_args.items()
                 if value is not None or name not in names}  # a misspelt name still fails
        self.engine = LLMEngine(EngineConfig(model=model, **given))

    def close(self) -> None:
        """End the engine's tensor-parallel workers (also done when the `LLM` is collected
        or the process exits)."""
        self.engine.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The model's tokenizer (vLLM's method), None for a preset without one."""
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, token ids, or vLLM's `{"prompt": text}` /
        `{"prompt_token_ids": ids}`); one output per prompt, in order, holding its
        `SamplingParams.n` completions. Every prompt is validated before any runs, so bad
        input raises and runs nothing."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        expanded = [(prompt, p.for_choice(i))
                    for prompt, p in zip(prompts, params, strict=True) for i in range(p.n)]
        ids = self.engine.add_requests([e[0] for e in expanded], [e[1] for e in expanded])
        try:
            finished = self._run(len(ids), use_tqdm)
        except BaseException:  # Ctrl-C or an error: these requests must not run on later
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        outputs, taken = [], iter(ids)
        for p in params:
            choices = [finished[next(taken)] for _ in range(p.n)]
            completions = [replace(c.outputs[0], index=i) for i, c in enumerate(choices)]
            outputs.append(replace(choices[0], outputs=completions))
        return outputs

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation or to each of several, each a
        list of {"role", "content"} messages (content a string or OpenAI's text parts)
        rendered with the chat template: the tokenizer's, or `chat_template`. As in vLLM,
        `continue_final_message` (with `add_generation_prompt=False`) continues the last
        message instead of starting a new one; `chat_template_kwargs` are more variables for
        the template (e.g. Qwen3's `enable_thinking`)."""
        if isinstance(messages, Mapping | str):
            raise TypeError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts "
                            f"(or a list of such lists), got a {type(messages).__name__}: wrap "
                            f"one message in a list")
        # A file's path is read as --chat-template reads it; ChatOptions names other types.
        template = (read_chat_template(os.fspath(chat_template))
                    if isinstance(chat_template, str | os.PathLike) else chat_template)
        options = ChatOptions(chat_template=template,
                              add_generation_prompt=add_generation_prompt,
                              continue_final_message=continue_final_message,
                              chat_template_kwargs=chat_template_kwargs)
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        several = len(conversations) > 1
        rendered = []
        for index, conversation in enumerate(conversations):
            with _named_conversation(index, several):
                rendered.append(self.engine.chat_prompt(conversation, options))
        texts = [text for text, _ in rendered]
        outputs = self.generate([ids for _, ids in rendered], sampling_params, use_tqdm)
        # as in vLLM, each output's prompt is the rendered conversation
        return [replace(output, prompt=text) for output, text in zip(outputs, texts, strict=True)]

    def apply_chat_template(self, messages: list[Message],
                            options: ChatOptions = DEFAULT_CHAT) -> list[int]:
        """The token ids of one conversation rendered with the chat template."""
        if not isinstance(options, ChatOptions):
            raise TypeError(f"options must be a ChatOptions(...) (bcg.engine.chat), got "
                            f"{type(options).__name__}")
        return self.engine.chat_token_ids(messages, options)

    def _run(self, num_requests: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=num_requests, desc="Generating", disable=not use_tqdm,
                  dynamic_ncols=True) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step(finished_only=True):
                    finished[output.request_id] = output
                    bar.update(1)
                stats = self.engine.stats
                bar.set_postfix_str(f"prefill {stats.prefill_throughput:.0f} tok/s, "
                                    f"decode {stats.decode_throughput:.0f} tok/s", refresh=False)
        logger.info("forwards so far: %s", dict(self.engine.runner.forward_counts))
        return finished


@contextmanager
def _named_conversation(index: int, several: bool) -> Iterator[None]:
    """A bad conversation's error, named by its index among several."""
    try:
        yield
    except ValueError as error:
        if not several:
            raise
        raise ValueError(f"conversation {index}: {error}") from None


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str | dict) or (
        isinstance(prompts, list) and prompts and is_token_id(prompts[0])
    ):
        prompts = [prompts]
    if not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a string, token ids, or a list of them; got "
                        f"{type(prompts).__name__}")
    return [_as_prompt(p) for p in prompts]


def _as_prompt(prompt) -> Prompt:
    """A text or token-id prompt; vLLM's dict prompts are unwrapped."""
    if isinstance(prompt, dict):
        if set(prompt) == {"prompt"}:
            return prompt["prompt"]
        if set(prompt) == {"prompt_token_ids"}:
            return prompt["prompt_token_ids"]
        raise ValueError(f"a dict prompt takes one key, 'prompt' (text) or 'prompt_token_ids'; "
                         f"got keys {sorted(map(str, prompt))}")
    return prompt


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    """One `SamplingParams` (or None, the defaults) for every prompt."""
    if params is None or isinstance(params, SamplingParams):
        return [replace(params or SamplingParams())] * count
    if isinstance(params, Mapping | str) or not isinstance(params, Iterable):
        raise TypeError(f"sampling_params must be a SamplingParams, a list of them or None, "
                        f"got {type(params).__name__}: build one with SamplingParams(...)")
    params = list(params)
    bad = [p for p in params if not isinstance(p, SamplingParams)]
    if bad:
        raise TypeError(f"sampling_params must hold SamplingParams, got a "
                        f"{type(bad[0]).__name__}: build each with SamplingParams(...)")
    check_one_per_prompt(range(count), params)
    # A copy checks again what was set on the params after they were built (params.n = 0).
    return [replace(p) for p in params]
