"""What the engine reports about a request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str  # generated text so far (all of it once finished)
    token_ids: list[int]  # generated token ids so far
    finished: bool
    finish_reason: str | None  # "stop" (EOS, stop token or string), "length", "abort"
    num_cached_tokens: int  # prompt tokens served from the prefix cache
