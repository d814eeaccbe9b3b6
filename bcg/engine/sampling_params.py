"""How one request is sampled and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from bcg.config import is_int, require


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # keep the most likely tokens up to this probability mass; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = off
    max_tokens: int = 16  # most new tokens
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the text)
    stop_token_ids: list[int] = field(default_factory=list)  # stop tokens besides EOS
    ignore_eos: bool = False  # keep generating past EOS
    seed: int | None = None  # reproducible sampling whatever else is in the batch

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        require(_is_number(self.temperature) and 0 <= self.temperature and
               math.isfinite(self.temperature),
               f"temperature must be a finite number >= 0, got {self.temperature!r}")
        require(_is_number(self.top_p) and 0 < self.top_p <= 1,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        require(is_int(self.top_k) and self.top_k >= -1,
               f"top_k must be an integer >= 1, or 0 / -1 for off; got {self.top_k!r}")
        require(is_int(self.max_tokens) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        require(all(isinstance(s, str) and s for s in self.stop),
               f"stop must be non-empty strings, got {self.stop!r}")
        require(all(is_int(t) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be token ids (integers >= 0), got {self.stop_token_ids!r}")
        require(self.seed is None or is_int(self.seed),
               f"seed must be an integer or None, got {self.seed!r}")


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)

