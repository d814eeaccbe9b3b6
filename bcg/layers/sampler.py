"""Token sampling: penalties, logit bias and banned tokens, then greedy or temperature,
top-k, top-p and min-p, with optional per-request generators; and the logprobs of chosen
tokens with their top alternatives. Everything runs on the logits' device, from tensors the
runner uploads without waiting, so no step adds a host sync.

Sampling draws `argmax(probs / E)` with E ~ Exp(1) per vocabulary entry, which picks token
i with probability probs[i]; a seeded request draws its E from its own generator, so its
tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from bcg.layers import triton_ops

# Below this a temperature samples like greedy: dividing logits by it would overflow.
GREEDY_BELOW = 1e-5
MAX_LOGPROBS = 20  # most alternatives per position (OpenAI's limit)


@dataclass
class Penalties:
    """The rows with repetition, frequency or presence penalties and the tokens they saw."""

    rows: torch.Tensor  # int64 [P]: rows of the batch
    token_ids: torch.Tensor  # int64 [P, L]: prompt and output tokens, padded with vocab size
    is_output: torch.Tensor  # float32 [P, L]: 1 where the token was generated, else 0
    presence: torch.Tensor  # float32 [P]
    frequency: torch.Tensor  # float32 [P]
    repetition: torch.Tensor  # float32 [P]


@dataclass
class SamplingBatch:
    # Per-row tensors; None when every row is greedy (they are never read then).
    temperatures: torch.Tensor | None  # float32 [S]; 0 = greedy
    top_k: torch.Tensor | None  # int64 [S]; vocabulary size = off
    top_p: torch.Tensor | None  # float32 [S]; 1.0 = off
    generators: list[torch.Generator | None]  # per row; None = the global generator
    all_greedy: bool
    any_top_k_top_p: bool
    min_p: torch.Tensor | None = None  # float32 [S]; None when no row asks for it
    penalties: Penalties | None = None
    # Added to logits at (row, token): logit bias, and -inf for tokens banned this step
    # (EOS and stop tokens before min_tokens).
    logit_adds: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class TokenLogprobs(NamedTuple):
    """Logprobs of one chosen token per row and of the row's most likely tokens."""

    logprobs: torch.Tensor  # float32 [R]
    ranks: torch.Tensor  # int64 [R]: 1 = the most likely token
    top_ids: torch.Tensor  # int64 [R, k]
    top_logprobs: torch.Tensor  # float32 [R, k]


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """`[S, vocab]` logits -> `[S]` int64 token ids (`logits` is left unchanged)."""
        if batch.all_greedy and batch.penalties is None and batch.logit_adds is None:
            # Exact in the logits' own dtype: no float copy of [S, vocab] (at batch 256 of a
            # 152k vocabulary the copy took longer than the argmax).
            return triton_ops.argmax_rows(logits)
        logits = logits.float()
        if batch.penalties is not None:
            logits = apply_penalties(logits, batch.penalties)
        if batch.logit_adds is not None:
            rows, token_ids, values = batch.logit_adds
            logits = logits.index_put((rows, token_ids), values, accumulate=True)
        greedy = triton_ops.argmax_rows(logits)
        if batch.all_greedy:
            return greedy
        temperatures = torch.where(batch.temperatures > 0, batch.temperatures, 1.0)
        logits = logits / temperatures.unsqueeze(1)
        if batch.any_top_k_top_p:
            logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
        probs = logits.softmax(dim=-1)
        if batch.min_p is not None:
            floor = batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        sampled = (probs / exponential_noise(probs, batch.generators)).argmax(dim=-1)
        return torch.where(batch.temperatures > 0, sampled, greedy)


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """Repetition (HF's: divide positive logits of seen tokens, multiply negative ones),
    then frequency (per earlier output occurrence) and presence (once) penalties, as vLLM
    and OpenAI define them; prompt tokens count as seen only for the repetition penalty."""
    rows, vocab_size = penalties.rows, logits.shape[1]
    num_rows = rows.shape[0]
    counts = torch.zeros(num_rows, vocab_size + 1, device=logits.device)
    counts = counts.scatter_add_(1, penalties.token_ids, penalties.is_output)[:, :vocab_size]
    seen = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=logits.device)
    seen = seen.scatter_(1, penalties.token_ids, True)[:, :vocab_size]
    picked = logits[rows]
    repetition = penalties.repetition[:, None]
    penalised = torch.where(picked > 0, picked / repetition, picked * repetition)
    picked = torch.where(seen, penalised, picked)
    picked = picked - penalties.frequency[:, None] * counts
    picked = picked - penalties.presence[:, None] * (counts > 0).float()
    return logits.index_put((rows,), picked)


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, num_top: int) -> TokenLogprobs:
    """Logprobs (log-softmax of the raw `logits` `[R, vocab]`) of `chosen` `[R]` and of each
    row's `num_top` most likely tokens."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen_logprobs = logprobs.gather(1, chosen[:, None]).squeeze(1)
    ranks = (logprobs > chosen_logprobs[:, None]).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return TokenLogprobs(chosen_logprobs, ranks, top_ids, top_logprobs)


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
