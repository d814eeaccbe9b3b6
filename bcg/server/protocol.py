"""Request and response shapes of the OpenAI API subset that `bcg serve` speaks.

Requests are parsed strictly (a string where a number belongs is an error, not coerced);
fields the server does not implement are ignored. Range checks live in `SamplingParams`,
so the HTTP API and `LLM` reject the same values with the same messages.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from bcg.engine.sampling_params import SamplingParams

MAX_N = 128


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingFields(StrictModel):
    """The request fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # not OpenAI's: keep generating past EOS (benchmarks)

    def sampling_params(self, choice_index: int, default_max_tokens: int) -> SamplingParams:
        """The params of one of the `n` choices; with a seed, choice i uses seed + i so the
        choices differ yet repeat across calls."""
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            stop=self.stop or [], seed=self.seed, ignore_eos=self.ignore_eos,
        ).for_choice(choice_index)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a batch: a string or a token-id list is a batch of one."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart]

    def as_template_input(self) -> dict[str, str]:
        content = self.content
        if not isinstance(content, str):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    def sampling_params(self, choice_index: int, default_max_tokens: int) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            default_max_tokens = self.max_completion_tokens
        return super().sampling_params(choice_index, default_max_tokens)


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
    code = {404: "not_found", 400: "bad_request"}.get(status)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
