"""`--verify-graphs`: replay every captured bucket on fresh inputs against the eager stack.

An op that reads per-step state but was captured instead of running as a break replays
its capture-time behaviour: the outputs then differ from eager on a new batch. Catch that
at start-up, naming the bucket, rather than as wrong tokens later.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import torch

from bcg.forward import ForwardBatch
from bcg.runner.batch import SyntheticSequence
from bcg.runner.graph_runner import GraphRunner
from bcg.runner.model_runner import ModelRunner
from bcg.utils import cdiv

logger = logging.getLogger(__name__)
# max |graph - eager| / max |eager| over the live rows. Same kernels on both sides agree
# to rounding; a captured per-step op is off by O(1). bf16 and compiled (piecewise) stacks
# round differently from eager, hence the margin.
TOLERANCE = 0.05
MAX_PREFIX = 48
VERIFIED_STATE_SLOTS = 2


@dataclass
class _BlockCursor:
    """Hands out cache blocks in order; at start-up they are all free."""

    num_blocks: int
    next_block: int = 0

    def take(self, count: int) -> list[int]:
        if self.next_block + count > self.num_blocks:
            self.next_block = 0
        blocks = list(range(self.next_block, self.next_block + count))
        self.next_block += count
        return blocks


def verify_graphs(runner: ModelRunner, seed: int = 0) -> None:
    """Compare every bucket of every graph runner of `runner` with eager, in random order
    (its caller runs this once the runner is built and its graphs captured)."""
    rng = random.Random(seed)
    checks = [(graph, bucket) for graph in runner.graph_runners for bucket in graph.buckets]
    rng.shuffle(checks)
    cursor = _BlockCursor(runner.num_kv_blocks)
    for graph, bucket in checks:
        batch = _fresh_batch(runner, graph, bucket, rng, cursor)
        with torch.inference_mode():
            slots = ([] if batch.state_slots is None
                     else [slot for slot in batch.state_slots.tolist() if slot >= 0])
            # Both runs must start from the same recurrent state: the graph's run moves it on.
            saved = runner.state_cache.save(slots) if slots else None
            replayed = graph.run(batch, bucket)[: batch.num_tokens].float()
            if saved is not None:
                runner.state_cache.restore(slots, saved)
            eager = runner.forward_eager(batch).float()
        error = ((replayed - eager).abs().max() / eager.abs().max().clamp_min(1e-6)).item()
        if not error <= TOLERANCE:
            raise RuntimeError(
                f"--verify-graphs: the {graph.kind} graph ({graph.mode}) for bucket {bucket} "
                f"differs from eager by {error:.3g} (max |graph - eager| / max |eager|, "
                f"tolerance {TOLERANCE}) on a batch of {batch.num_seqs} sequences, "
                f"{batch.num_tokens} tokens. An op that reads per-step state was probably "
                f"captured instead of running as a graph break; start with --{graph.kind}-graph "
                f"none to run without these graphs"
            )
    logger.info("--verify-graphs: %d buckets replayed, all equal to eager", len(checks))


def _fresh_batch(runner: ModelRunner, graph: GraphRunner, bucket: int, rng: random.Random,
                 cursor: _BlockCursor) -> ForwardBatch:
    """A random batch that fits `bucket` and needs most of it (so padding is exercised)."""
    smaller = [b for b in graph.buckets if b < bucket]
    size = rng.randint((smaller[-1] + 1) if smaller else 1, bucket)
    vocab = runner.model_config.vocab_size
    max_len = runner.max_model_len
    if graph.kind == "decode":
        new_tokens = [1] * size
    else:
        fewest = cdiv(size, max(1, max_len - MAX_PREFIX))  # no sequence past max_model_len
        new_tokens = _split(size, max(fewest, rng.randint(1, min(4, size))))
    seqs = []
    for n in new_tokens:
        prefix = rng.randint(0, min(MAX_PREFIX, max_len - n))
        tokens = [rng.randrange(vocab) for _ in range(prefix + n)]
        blocks = cursor.take(cdiv(prefix + n, runner.block_size))
        # A hybrid's first sequences read and write real state slots (a few: each is saved
        # and restored per check), so a graph that ignored the live slots would differ.
        slot = len(seqs) if len(seqs) < min(VERIFIED_STATE_SLOTS, runner.num_state_slots) else -1
        seqs.append(SyntheticSequence(tokens, blocks, num_computed_tokens=prefix,
                                      state_slot=slot))
    return runner.prepare(seqs, new_tokens)


def _split(total: int, parts: int) -> list[int]:
    """`total` tokens in `parts` sequences of nearly equal length."""
    return [total // parts + (index < total % parts) for index in range(parts)]
