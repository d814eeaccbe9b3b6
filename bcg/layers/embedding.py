"""Token embedding and the logits head (which may share the embedding's weight), each rank
holding an equal slice of the vocabulary (padded to a multiple of the ranks)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from bcg.distributed.parallel_state import tensor_parallel
from bcg.layers.linear import check_shape, linear
from bcg.utils import cdiv


class VocabSlice(nn.Module):
    """The rows `[start, start + rows)` of a vocabulary padded to a multiple of the ranks."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp = tensor_parallel()
        self.vocab_size = vocab_size
        padded = cdiv(vocab_size, self.tp.size) * self.tp.size
        self.start, rows = self.tp.shard(padded, "the padded vocabulary")
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)

    def load_weight(self, name: str, loaded: torch.Tensor) -> None:
        """This rank's rows of the full `[vocab, hidden]` tensor; padding rows are zero."""
        check_shape(name, loaded, (self.vocab_size, self.weight.shape[1]))
        real = max(0, min(self.weight.shape[0], self.vocab_size - self.start))
        self.weight.data[real:].zero_()
        self.weight.data[:real].copy_(loaded[self.start : self.start + real])

    def fill_dummy(self, name: str, draw: Callable[..., torch.Tensor]) -> None:
        """Random rows (`draw(shape)`) for the whole vocabulary, this rank's kept."""
        self.load_weight(name, draw((self.vocab_size, self.weight.shape[1])))


class Embedding(VocabSlice):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        embedded = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(embedded.masked_fill(outside[:, None], 0.0))


class LMHead(VocabSlice):
    def tie_to(self, embedding: Embedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[S, hidden]` -> `[S, vocab]` logits on every rank."""
        logits = self.tp.all_gather_last_dim(linear(hidden_states, self.weight))
        return logits[:, : self.vocab_size]
