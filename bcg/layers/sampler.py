"""Token sampling: greedy, temperature, top-k, top-p, with optional per-request generators.

Sampling draws `argmax(probs / E)` with E ~ Exp(1) per vocabulary entry, which picks token
i with probability probs[i]; a seeded request draws its E from its own generator, so its
tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    # Per-row tensors; None when every row is greedy (they are never read then).
    temperatures: torch.Tensor | None  # float32 [S]; 0 = greedy
    top_k: torch.Tensor | None  # int64 [S]; vocabulary size = off
    top_p: torch.Tensor | None  # float32 [S]; 1.0 = off
    generators: list[torch.Generator | None]  # per row; None = the global generator
    all_greedy: bool
    any_top_k_top_p: bool


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """`[S, vocab]` logits -> `[S]` int64 token ids."""
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        if batch.all_greedy:
            return greedy
        temperatures = torch.where(batch.temperatures > 0, batch.temperatures, 1.0)
        logits = logits / temperatures.unsqueeze(1)
        if batch.any_top_k_top_p:
            logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
        probs = logits.softmax(dim=-1)
        sampled = (probs / exponential_noise(probs, batch.generators)).argmax(dim=-1)
        return torch.where(batch.temperatures > 0, sampled, greedy)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Set to -inf every logit outside the row's k largest, then outside the smallest set of
    most likely tokens whose (renormalised) probabilities sum to at least top_p."""
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    kth_largest = sorted_logits.gather(1, (vocab_size - top_k).clamp(0, vocab_size - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_p)[:, None]
    drop[:, -1] = False  # the most likely token always stays
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def exponential_noise(
    probs: torch.Tensor, generators: list[torch.Generator | None]
) -> torch.Tensor:
    noise = torch.empty_like(probs).exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    return noise.clamp_min_(1e-10)
