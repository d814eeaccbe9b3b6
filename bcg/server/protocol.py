"""Request and response shapes of the OpenAI API subset that `bcg serve` speaks, with
vLLM's extra sampling fields and its /tokenize and /detokenize bodies.

Requests are parsed strictly: a string where a number belongs is an error, not coerced,
and a field the server does not implement is an error naming it, never silently ignored
(OpenAI fields that it does not implement are accepted only with their no-op values, e.g.
`best_of: 1` or `tools: []`). Every string must be valid Unicode: JSON lets a client send a
lone UTF-16 surrogate ("\\ud800"), which nothing downstream could encode. Range checks live
in `SamplingParams`, so the HTTP API and `LLM` reject the same values with the same messages.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from bcg.engine.chat import ChatOptions, content_problem
from bcg.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from bcg.server.engine_loop import ChatPrompt
from bcg.utils import LONE_SURROGATE

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        _check_unicode(data, "")
        return data


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)


def _check_unicode(value: Any, path: str) -> None:
    """Raise naming the first string (value or dict key) under `value` that holds a lone
    UTF-16 surrogate; `path` is where `value` sits in the body ("" at the top)."""
    if isinstance(value, str):
        found = LONE_SURROGATE.search(value)
        if found:
            raise PydanticCustomError(
                "lone_surrogate",
                "{path} holds a lone UTF-16 surrogate (\\u{code}) at character {at}, which is "
                "not valid Unicode: send well-formed strings (a surrogate pair for characters "
                "beyond U+FFFF)",
                {"path": path or "the body", "code": f"{ord(found.group()):04x}",
                 "at": found.start()})
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, f"a key of {path or 'the body'}")
            _check_unicode(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if type(item) is not int:  # token ids: the common long list
                _check_unicode(item, f"{path}.{i}")


class StreamOptions(StrictModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: usage in every chunk


class SamplingFields(StrictModel):
    """The request fields shared by completions and chat completions. OpenAI's optional
    fields also accept null, meaning their default."""

    model: str | None = None  # as in vLLM: the served model when left out
    max_tokens: int | None = None  # None: up to max_model_len
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None  # token id (a string in JSON) -> bias
    min_tokens: int | None = None
    n: int | None = Field(None, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None  # vLLM's: keep generating past EOS (benchmarks)
    prompt_logprobs: int | None = None  # vLLM's: logprobs of the prompt tokens
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user id, for the caller's records: not used
    skip_special_tokens: bool | None = None  # vLLM's: special tokens left out of text (true)
    include_stop_str_in_output: bool | None = None  # vLLM's: keep the stop string (false)
    # vLLM's, accepted and not used: like vLLM with a fast tokenizer, the text of special
    # tokens is never spaced apart.
    spaces_between_special_tokens: bool | None = None

    _streamed_prompt_logprobs_instead: ClassVar[str] = ""  # a hint for the refusal
    prompt_field: ClassVar[str] = "prompt"  # the field an error in the prompt names

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_id_keys(cls, bias: Any) -> Any:
        """OpenAI sends token ids as JSON object keys, so as strings: '123' -> 123."""
        if not isinstance(bias, dict):
            return bias
        converted = {}
        for key, value in bias.items():
            if not (isinstance(key, str) and re.fullmatch(r"[0-9]{1,10}", key)):
                raise ValueError(f"the keys must be token ids (integers, as strings), got {key!r}")
            converted[int(key)] = value
        return converted

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def logprobs_per_token(self) -> int | None:
        """Alternatives per generated token (`SamplingParams.logprobs`); None: no logprobs."""
        return None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for the first field that asks for something not implemented
        (subclasses check their own fields, then these)."""
        if self.stream and self.prompt_logprobs is not None:
            return ("prompt_logprobs", "prompt_logprobs are not available when streaming"
                                       + self._streamed_prompt_logprobs_instead)
        if self.stream_options is not None and not self.stream:
            return ("stream_options", "stream_options are only allowed with stream: true")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            return ("stream_options.continuous_usage_stats", "usage in every chunk is not "
                    "supported: include_usage gives it in a last chunk")
        return None

    def requested_max_tokens(self) -> int | None:
        """The cap on new tokens this request sets; None: up to max_model_len."""
        return self.max_tokens

    def param_of(self, field: str) -> str:
        """The request field that sets `SamplingParams.field`."""
        return field

    def sampling_params(self) -> SamplingParams:
        """The engine params of this request (n choices: see `SamplingParams.for_choice`)."""
        max_tokens = self.requested_max_tokens()
        return SamplingParams(
            n=self.num_choices,
            temperature=_default(self.temperature, 1.0),
            top_p=_default(self.top_p, 1.0),
            top_k=_default(self.top_k, 0),
            min_p=_default(self.min_p, 0.0),
            presence_penalty=_default(self.presence_penalty, 0.0),
            frequency_penalty=_default(self.frequency_penalty, 0.0),
            repetition_penalty=_default(self.repetition_penalty, 1.0),
            logit_bias=self.logit_bias or None,
            max_tokens=max_tokens,
            min_tokens=_default(self.min_tokens, 0),
            stop=_default(self.stop, []),
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=bool(self.ignore_eos),
            skip_special_tokens=_default(self.skip_special_tokens, True),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            seed=self.seed,
            logprobs=self.logprobs_per_token(),
            prompt_logprobs=self.engine_prompt_logprobs(max_tokens),
        )

    def engine_prompt_logprobs(self, max_tokens: int | None) -> int | None:
        return self.prompt_logprobs


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = COMPLETION_DEFAULT_MAX_TOKENS  # as in vLLM: null is no cap
    echo: bool | None = False  # the response's text (and logprobs) start with the prompt's
    logprobs: int | None = None  # logprobs of each token and of this many alternatives
    best_of: int | None = None  # only 1: candidates ranked server-side are not implemented
    suffix: str | None = None  # insertion (text after the completion) is not implemented

    _streamed_prompt_logprobs_instead: ClassVar[str] = " (use echo with logprobs)"

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt_form(cls, value: Any) -> Any:
        """One message for any wrong form (else one per member of the union, per element)."""
        if isinstance(value, str) or _token_ids(value) or (isinstance(value, list) and (
                all(isinstance(p, str) for p in value) or all(_token_ids(p) for p in value))):
            return value
        raise ValueError("must be a string, a list of strings, a list of token ids (integers) "
                         "or a list of token-id lists, one form for the whole list")

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a batch: a string or a token-id list is a batch of one."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)

    def logprobs_per_token(self) -> int | None:
        return self.logprobs

    def engine_prompt_logprobs(self, max_tokens: int | None) -> int | None:
        """vLLM's rule: echo with logprobs scores the prompt with as many alternatives; echo
        of a prompt with nothing to generate still needs the prompt run (score it, bare)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            return self.logprobs
        if self.echo and max_tokens == 0:
            return 0
        return None

    def unsupported(self) -> tuple[str, str] | None:
        if self.best_of not in (None, 1) and self.best_of != self.num_choices:
            return ("best_of", "best_of > n (sampling candidates and returning the most likely "
                               "ones) is not supported: use n")
        if self.suffix:
            return ("suffix", "suffix (insertion) is not supported")
        return super().unsupported()


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None  # OpenAI's: only an assistant's may be null
    name: str | None = None  # passed to the chat template, which may use it
    # What clients send back with an earlier assistant reply: taken at their no-op values
    # (no tool ran, nothing refused, no citations), never passed to the template.
    tool_calls: list[Any] | None = None
    annotations: list[Any] | None = None
    refusal: None = None
    function_call: None = None
    audio: None = None
    NOT_RENDERED: ClassVar[frozenset[str]] = frozenset(
        {"tool_calls", "annotations", "refusal", "function_call", "audio"})

    @field_validator("content", mode="before")
    @classmethod
    def _text_or_parts(cls, value: Any) -> Any:
        problem = None if value is None else content_problem(value)
        if problem is None and isinstance(value, list):
            extra = sorted({key for part in value for key in part} - {"type", "text"})
            problem = extra and f"parts take only 'type' and 'text' here, got {extra}"
        if problem:  # one message, not one per member of the field's union
            raise ValueError(problem)
        return value

    @field_validator("tool_calls", "annotations")
    @classmethod
    def _none_listed(cls, value: list[Any] | None, info: ValidationInfo) -> list[Any] | None:
        if value and info.data.get("role") == "assistant":
            raise ValueError(f"{info.field_name} are not supported (this server runs no tools "
                             f"and cites nothing): send null or [] with an earlier reply")
        if value is not None and info.data.get("role") != "assistant":
            raise ValueError(f"only an assistant message carries {info.field_name}")
        return value

    @field_validator("refusal", "function_call", "audio", mode="before")
    @classmethod
    def _null_only(cls, value: Any, info: ValidationInfo) -> None:
        if value is not None:
            raise ValueError(f"{info.field_name} is not supported: send null or leave it out")
        return value

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (a string or text parts)")
        return self

    def as_template_input(self) -> dict[str, Any]:
        """The message as `bcg.engine.chat` takes it (text parts joined there)."""
        return self.model_dump(exclude_none=True, exclude=self.NOT_RENDERED)


class ChatTemplateFields(StrictModel):
    """vLLM's fields that choose how messages are rendered (chat completions, /tokenize)."""

    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool | None = True  # end ready for the assistant's reply
    continue_final_message: bool | None = False  # the reply continues the last message
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template

    def chat_prompt(self, add_special_tokens: bool, chat_template: str | None) -> ChatPrompt:
        """The conversation and how to render it (`chat_template`: the server's, or None for
        the tokenizer's)."""
        options = ChatOptions(chat_template=chat_template,
                              add_generation_prompt=_default(self.add_generation_prompt, True),
                              continue_final_message=bool(self.continue_final_message),
                              add_special_tokens=add_special_tokens,
                              chat_template_kwargs=self.chat_template_kwargs)
        return ChatPrompt([m.as_template_input() for m in self.messages or []], options)


class ChatCompletionRequest(ChatTemplateFields, SamplingFields):
    prompt_field: ClassVar[str] = "messages"

    messages: list[ChatMessage] = Field(min_length=1)
    add_special_tokens: bool | None = False  # vLLM's: BOS on top of the template's
    max_completion_tokens: int | None = None
    logprobs: bool | None = False  # logprobs of each generated token
    # ... and this many likeliest; checked here: SamplingParams would name `logprobs`
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # OpenAI fields this server does not implement, accepted only with a no-op value.
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # meaningless without tools
    echo: bool | None = None  # vLLM's, accepted only false: the reply never starts with the
    # last message

    def logprobs_per_token(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> tuple[str, str] | None:
        if self.tools:
            return ("tools", "tool calling is not supported")
        if self.tool_choice not in (None, "none", "auto"):
            return ("tool_choice", "tool calling is not supported")
        if self.functions:
            return ("functions", "function calling is not supported")
        if self.function_call not in (None, "none", "auto"):
            return ("function_call", "function calling is not supported")
        if self.response_format not in (None, {"type": "text"}):
            return ("response_format", "structured output (response_format other than "
                                       "{'type': 'text'}) is not supported")
        if self.top_logprobs is not None and not self.logprobs:
            return ("top_logprobs", "top_logprobs needs logprobs: true")
        if self.echo:
            return ("echo", "echo (the reply starting with the last message) is not supported")
        return super().unsupported()

    def requested_max_tokens(self) -> int | None:
        """OpenAI's max_completion_tokens, else the older max_tokens (as vLLM reads them)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def param_of(self, field: str) -> str:
        if field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return "top_logprobs" if field == "logprobs" else field


class TokenizeRequest(ChatTemplateFields):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    return_token_strs: bool | None = False


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def make_usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """OpenAI's error envelope."""
    kind = "invalid_request_error" if status < 500 else "internal_server_error"
    code = {400: "bad_request", 404: "not_found", 413: "request_too_large"}.get(status)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _default(value, default):
    return default if value is None else value
