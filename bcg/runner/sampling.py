"""From scheduled sequences to what the sampler reads, and sampled logprobs back to Python.

Per-row options travel as small tensors, copied from pinned memory without waiting; options
no row uses stay None so the sampler skips them (most steps are plain greedy or top-p).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bcg.layers.sampler import GREEDY_BELOW, Penalties, SamplingBatch, TokenLogprobs
from bcg.runner.batch import SamplingOptions, ScheduledSequence

# One position's logprobs: (chosen token's logprob, its rank, [(token, logprob)] of the top).
PositionLogprobs = tuple[float, int, list[tuple[int, float]]]


@dataclass
class SamplingContext:
    """What sampling needs besides the sequences: the device, vocabulary and EOS tokens."""

    device: torch.device
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    def upload(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        pin = self.device.type == "cuda"
        host = torch.tensor(values, dtype=dtype, pin_memory=pin)
        return host.to(self.device, non_blocking=True)


class SampledTokens:
    """A step's sampled ids on their way to the host: the copy starts at once (into pinned
    memory, on CUDA) and is waited for only when read, so the host can issue the next step
    meanwhile."""

    def __init__(self, token_ids: torch.Tensor) -> None:
        self._ready = None
        if token_ids.is_cuda:
            host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            token_ids = host.copy_(token_ids, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        self._host = token_ids

    @classmethod
    def none(cls) -> SampledTokens:
        return cls(torch.empty(0, dtype=torch.int64))

    def tolist(self) -> list[int]:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()


def build_sampling_batch(seqs: list[ScheduledSequence], ctx: SamplingContext) -> SamplingBatch:
    params = [seq.sampling_params for seq in seqs]
    generators = [seq.generator for seq in seqs]
    processing = [i for i, p in enumerate(params) if p.processes_logits]
    penalties = _penalties(seqs, processing, ctx) if processing else None
    logit_adds = _logit_adds(seqs, processing, ctx) if processing else None
    if all(p.temperature < GREEDY_BELOW for p in params):  # no per-row tensors to build
        return SamplingBatch(temperatures=None, top_k=None, top_p=None, generators=generators,
                             all_greedy=True, any_top_k_top_p=False, penalties=penalties,
                             logit_adds=logit_adds)
    vocab_size = ctx.vocab_size
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    temperatures = [p.temperature if p.temperature >= GREEDY_BELOW else 0.0 for p in params]
    any_min_p = any(p.min_p > 0 for p in params)
    return SamplingBatch(
        temperatures=ctx.upload(temperatures, torch.float32),
        top_k=ctx.upload(top_k, torch.int64),
        top_p=ctx.upload([p.top_p for p in params], torch.float32),
        generators=generators,
        all_greedy=False,
        any_top_k_top_p=any(k < vocab_size for k in top_k) or any(p.top_p < 1 for p in params),
        min_p=ctx.upload([p.min_p for p in params], torch.float32) if any_min_p else None,
        penalties=penalties,
        logit_adds=logit_adds,
    )


def _has_penalties(p: SamplingOptions) -> bool:
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1


def _penalties(seqs: list[ScheduledSequence], candidates: list[int],
               ctx: SamplingContext) -> Penalties | None:
    rows = [i for i in candidates if _has_penalties(seqs[i].sampling_params)]
    if not rows:
        return None
    width = max(len(seqs[i].token_ids) for i in rows)
    token_ids, is_output = [], []
    for i in rows:
        seq = seqs[i]
        pad = width - len(seq.token_ids)
        token_ids.append(list(seq.token_ids) + [ctx.vocab_size] * pad)
        num_output = len(seq.token_ids) - seq.num_prompt_tokens
        is_output.append([0.0] * seq.num_prompt_tokens + [1.0] * num_output + [0.0] * pad)
    params = [seqs[i].sampling_params for i in rows]
    return Penalties(
        rows=ctx.upload(rows, torch.int64),
        token_ids=ctx.upload(token_ids, torch.int64),
        is_output=ctx.upload(is_output, torch.float32),
        presence=ctx.upload([p.presence_penalty for p in params], torch.float32),
        frequency=ctx.upload([p.frequency_penalty for p in params], torch.float32),
        repetition=ctx.upload([p.repetition_penalty for p in params], torch.float32),
    )


def _logit_adds(seqs: list[ScheduledSequence], candidates: list[int], ctx: SamplingContext):
    """(rows, token ids, values) for logit biases and for tokens banned by min_tokens."""
    rows, token_ids, values = [], [], []
    for row in candidates:
        seq = seqs[row]
        p = seq.sampling_params
        for token_id, bias in (p.logit_bias or {}).items():  # ids checked on admission
            rows.append(row)
            token_ids.append(token_id)
            values.append(float(bias))
        if len(seq.token_ids) - seq.num_prompt_tokens < p.min_tokens:
            banned = {*ctx.eos_token_ids, *p.stop_token_ids}
            banned = [t for t in banned if t < ctx.vocab_size]
            rows += [row] * len(banned)
            token_ids += banned
            values += [float("-inf")] * len(banned)
    if not rows:
        return None
    return (ctx.upload(rows, torch.int64), ctx.upload(token_ids, torch.int64),
            ctx.upload(values, torch.float32))


def to_python(result: TokenLogprobs, num_tops: list[int]) -> list[PositionLogprobs]:
    """Row i's logprobs with its own `num_tops[i]` alternatives, on the host."""
    logprobs, ranks, top_ids, top_logprobs = (t.tolist() for t in result)
    return [(logprobs[i], ranks[i], list(zip(top_ids[i][:k], top_logprobs[i][:k], strict=True)))
            for i, k in enumerate(num_tops)]
