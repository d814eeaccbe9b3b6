"""Logprobs in OpenAI's response shapes, as vLLM fills them.

The engine reports, per token, a dict token id -> `Logprob` holding the chosen token first
and then the top alternatives. Completions want parallel lists (`tokens`, `token_logprobs`,
`top_logprobs` as {token string: logprob} with the chosen token and up to `logprobs`
alternatives, `text_offset`); chat wants a `content` list of {token, logprob, bytes,
top_logprobs}. -inf (and NaN) become -9999.0, as OpenAI sends, since JSON has neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bcg.engine.outputs import Logprob, PositionLogprobs

LOGPROB_FLOOR = -9999.0


def clamp(logprob: float) -> float:
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN compares False


class TokenText:
    """Token strings without the tokenizer (only the engine thread may use it): the engine's
    `decoded_token` when it has one, else a string made on the engine thread (`known`: a
    prompt's first token, the one position without logprobs), else `str(token_id)` (a model
    without a tokenizer: a preset with dummy weights)."""

    def __init__(self, known: dict[int, str] | None = None) -> None:
        self.known = known or {}

    def token(self, token_id: int, entry: Logprob | None = None) -> str:
        if entry is not None and entry.decoded_token is not None:
            return entry.decoded_token
        return self.known.get(token_id, str(token_id))


@dataclass
class EchoText:
    """What echoing a prompt takes from the tokenizer: the prompt as text (token-id prompts;
    "" without a tokenizer, like outputs) and the strings of its first token (`TokenText`)."""

    text: str | None
    tokens: TokenText


def echo_text(tokenizer, token_ids: Sequence[int], as_text: bool) -> EchoText:
    """A prompt's `EchoText`, for the engine thread; `as_text`: decode the whole prompt too."""
    if tokenizer is None:
        return EchoText("" if as_text else None, TokenText())
    text = tokenizer.decode(list(token_ids)) if as_text else None
    first = token_ids[0]
    return EchoText(text, TokenText({first: tokenizer.decode([first])}))


def completion_logprobs(token_ids: Sequence[int],
                        positions: Sequence[PositionLogprobs | None],
                        num_alternatives: int, text: TokenText, offset: int) -> dict:
    """/v1/completions' `logprobs` for these tokens; `offset`: the text offset of the first
    (each next one adds the length of the token string before it). A position without
    logprobs (a prompt's first token) has null `token_logprobs` and `top_logprobs` entries."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for token_id, position in zip(token_ids, positions, strict=True):
        chosen = None if position is None else position.get(token_id)
        token = text.token(token_id, chosen)
        tokens.append(token)
        text_offset.append(offset)
        offset += len(token)
        if chosen is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(clamp(chosen.logprob))
        # The chosen token, then up to `num_alternatives` of the most likely (vLLM's rule).
        top: dict[str, float] = {}
        for i, (top_id, entry) in enumerate(position.items()):
            if i > num_alternatives:
                break
            top.setdefault(text.token(top_id, entry), clamp(entry.logprob))
        top_logprobs.append(top)
    return {"text_offset": text_offset, "token_logprobs": token_logprobs, "tokens": tokens,
            "top_logprobs": top_logprobs}


def chat_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs | None],
                  num_alternatives: int, text: TokenText) -> list[dict]:
    """/v1/chat/completions' `logprobs.content` for these tokens: each with the
    `num_alternatives` most likely tokens of its position, most likely first."""
    content = []
    for token_id, position in zip(token_ids, positions, strict=True):
        chosen = None if position is None else position.get(token_id)
        entry = _chat_entry(text.token(token_id, chosen),
                            LOGPROB_FLOOR if chosen is None else chosen.logprob)
        ranked = sorted((position or {}).items(), key=lambda item: item[1].rank)
        entry["top_logprobs"] = [_chat_entry(text.token(top_id, top), top.logprob)
                                 for top_id, top in ranked[:num_alternatives]]
        content.append(entry)
    return content


def prompt_logprobs_json(positions: Sequence[PositionLogprobs | None] | None) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}}."""
    if positions is None:
        return None
    return [None if position is None else {
        str(token_id): {"logprob": clamp(entry.logprob), "rank": entry.rank,
                        "decoded_token": entry.decoded_token}
        for token_id, entry in position.items()} for position in positions]


def _chat_entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": clamp(logprob),
            "bytes": list(token.encode("utf-8", errors="replace"))}
