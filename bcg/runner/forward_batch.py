"""The per-step tensors the model and attention read, built once per step by the runner.

Graph runners copy these fields into static buffers of the same names, so the field names
are the contract between the eager runner, the graph runners and the attention op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # int64 [num_tokens]: new tokens of all sequences, in order
    positions: torch.Tensor  # int64 [num_tokens]: position of each token in its sequence
    slot_mapping: torch.Tensor  # int64 [num_tokens]: KV cache slot of each token; < 0 skips
    cu_seqlens_q: torch.Tensor  # int32 [num_seqs + 1]: offsets of each sequence's new tokens
    seq_lens: torch.Tensor  # int32 [num_seqs]: KV length of each sequence incl. new tokens
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]: cache blocks, -1 padded
    sample_indices: torch.Tensor  # int64 [num_samples]: token rows whose logits are sampled
    num_tokens: int  # real (unpadded) token count
    num_seqs: int
    max_seqlen_q: int  # most new tokens of one sequence (1 for a pure decode step)
    max_seq_len: int  # longest KV length in the batch

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token."""
        return self.max_seqlen_q == 1
