"""What the engine reports about a request, in vLLM's shape: a `RequestOutput` per prompt
holding one `CompletionOutput` per generated sequence (`SamplingParams.n` of them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# Per position: the chosen token's Logprob and those of the top alternatives, by token id.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int  # which of the request's n sequences
    text: str  # generated text so far (all of it once finished)
    token_ids: list[int]  # generated token ids so far
    finish_reason: str | None  # "stop" (EOS, stop token or string), "length", "abort"
    # vLLM's: the stop string or stop token id that ended it; None for EOS and the others
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None  # one per generated token, if asked for
    cumulative_logprob: float | None = None  # sum of the generated tokens' logprobs

    def finished(self) -> bool:  # a method, as vLLM's
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # One per prompt token, the first None (nothing predicts it), if asked for.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
