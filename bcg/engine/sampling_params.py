"""How one request is sampled and when it stops (vLLM's `SamplingParams` fields)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from bcg.config import require_field
from bcg.layers.sampler import MAX_LOGPROBS
from bcg.utils import invalid_unicode, is_int, is_number


@dataclass
class SamplingParams:
    n: int = 1  # sequences generated per prompt
    temperature: float = 1.0  # 0 (or below 1e-5, where dividing would overflow) = greedy
    top_p: float = 1.0  # keep the most likely tokens up to this probability mass; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = off
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one; 0 = off
    presence_penalty: float = 0.0  # subtracted from tokens already generated; 0 = off
    frequency_penalty: float = 0.0  # subtracted once per earlier occurrence in the output
    repetition_penalty: float = 1.0  # divides (multiplies if < 0) logits of seen tokens; 1 = off
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    # Most new tokens (None: up to max_model_len); 0 only scores the prompt (with
    # prompt_logprobs).
    max_tokens: int | None = 16
    min_tokens: int = 0  # no EOS or stop token before this many new tokens
    stop: list[str] = field(default_factory=list)  # stop strings (cut from the text)
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text
    stop_token_ids: list[int] = field(default_factory=list)  # stop tokens besides EOS
    ignore_eos: bool = False  # keep generating past EOS
    skip_special_tokens: bool = True  # leave special tokens (<|im_end|>, ...) out of the text
    seed: int | None = None  # reproducible sampling whatever else is in the batch
    logprobs: int | None = None  # logprobs of each new token and of this many alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        require_field("stop", isinstance(self.stop, list | tuple) and
                      all(isinstance(s, str) and s for s in self.stop),
                      f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        self.stop = list(self.stop)
        for index, stop in enumerate(self.stop):
            invalid = invalid_unicode(stop)
            require_field("stop", invalid is None,
                          f"stop string {index} {invalid}: no text could ever match it")
        require_field("stop_token_ids", isinstance(self.stop_token_ids, list | tuple) and
                      all(is_int(t) and t >= 0 for t in self.stop_token_ids),
                      f"stop_token_ids must be a list of token ids (integers >= 0), got "
                      f"{self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        self._check_numbers()
        self._check_logit_bias()
        # Read every step. Penalties read earlier tokens' values on the host, so an
        # overlapped step waits for its sequences' last tokens before the next is built.
        self.has_penalties = bool(self.presence_penalty or self.frequency_penalty
                                  or self.repetition_penalty != 1)
        self.processes_logits = bool(self.logit_bias or self.min_tokens or self.has_penalties)

    def _check_numbers(self) -> None:
        _check(self.n, "n", is_int(self.n) and self.n >= 1, "an integer >= 1")
        _check(self.temperature, "temperature", is_number(self.temperature) and
               0 <= self.temperature and math.isfinite(self.temperature), "a finite number >= 0")
        _check(self.top_p, "top_p", is_number(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]")
        _check(self.top_k, "top_k", is_int(self.top_k) and self.top_k >= -1,
               "an integer >= 1, or 0 / -1 for off")
        _check(self.min_p, "min_p", is_number(self.min_p) and 0 <= self.min_p <= 1, "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(value, name, is_number(value) and -2 <= value <= 2, "a number in [-2, 2]")
        _check(self.repetition_penalty, "repetition_penalty",
               is_number(self.repetition_penalty) and 0 < self.repetition_penalty and
               math.isfinite(self.repetition_penalty), "a finite number > 0")
        _check(self.max_tokens, "max_tokens", self.max_tokens is None or (
            is_int(self.max_tokens) and self.max_tokens >= 0),
            "an integer >= 0, or None (up to max_model_len)")
        _check(self.min_tokens, "min_tokens", is_int(self.min_tokens) and 0 <= self.min_tokens
               and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
               "an integer in [0, max_tokens]")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _check(getattr(self, name), name, isinstance(getattr(self, name), bool),
                   "true or false")
        _check(self.seed, "seed", self.seed is None or (
            is_int(self.seed) and -2**63 <= self.seed < 2**64), "None or a 64-bit integer")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value, name, value is None or (is_int(value) and 0 <= value <= MAX_LOGPROBS),
                   f"None or an integer in [0, {MAX_LOGPROBS}]")
        require_field("max_tokens", self.max_tokens != 0 or self.prompt_logprobs is not None,
                      "max_tokens=0 generates nothing: it only scores the prompt, so ask for "
                      "prompt_logprobs too (or raise max_tokens)")

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        require_field("logit_bias", bias is None or (isinstance(bias, dict) and all(
            is_int(t) and t >= 0 and is_number(b) and -100 <= b <= 100
            for t, b in bias.items())),
            f"logit_bias must map token ids (integers >= 0) to numbers in [-100, 100], got "
            f"{bias!r}")

    def for_choice(self, index: int) -> SamplingParams:
        """The params of completion `index` of the n: one sequence each (the engine runs n
        requests); with a seed, completion i uses seed + i so the n differ (past the largest
        64-bit seed, counting on from 0)."""
        seed = None if self.seed is None else self.seed + index
        if seed is not None and seed >= 2**64:
            seed -= 2**64
        return replace(self, n=1, seed=seed)


def _check(value, name: str, ok: bool, expected: str) -> None:
    require_field(name, ok, f"{name} must be {expected}, got {value!r}")
