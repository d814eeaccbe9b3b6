"""The runners' concrete registries: padded tails can never touch the KV cache."""

from types import SimpleNamespace

import torch

from bcg.forward import ForwardBatch, ForwardContext, KVCache
from bcg.layers.attention_backend import TritonAttention
from bcg.runner.batch import SyntheticSequence, build_batch
from bcg.runner.decode_graph import build_decode_registry
from bcg.runner.prefill_graph import PrefillGraphRunner, build_prefill_registry
from tests.numerics import poison_registry

# The decode registry writes cu_seqlens_q (0..bs) once, at allocation, never in a fill.
WRITTEN_ONCE = ["cu_seqlens_q"]


def decode_batch(seq_lens: list[int], blocks: int) -> ForwardBatch:
    n = len(seq_lens)
    return ForwardBatch(
        input_ids=torch.arange(10, 10 + n),
        positions=torch.tensor([s - 1 for s in seq_lens]),
        slot_mapping=torch.arange(100, 100 + n),
        cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.full((n, blocks), 7, dtype=torch.int32),
        sample_indices=torch.arange(n),
        state_slots=torch.arange(n, dtype=torch.int32),
        num_tokens=n,
        num_seqs=n,
        max_seqlen_q=1,
        max_seq_len=max(seq_lens),
    )


def test_decode_registry_pads_rows_harmlessly():
    registry = build_decode_registry(torch.device("cpu"), max_bs=8, max_blocks_per_seq=4,
                                     stateful=True)
    poison_registry(registry, keep=WRITTEN_ONCE)
    registry.fill_from(decode_batch([5, 9, 17], blocks=2), raw_bs=3, padded_bs=8,
                       raw_num_tokens=3, padded_num_tokens=8)
    view = registry.extract_buffer(padded_bs=8, padded_num_tokens=8,
                                   template=decode_batch([1], blocks=1))
    assert view.input_ids.tolist() == [10, 11, 12, 0, 0, 0, 0, 0]
    assert view.positions.tolist() == [4, 8, 16, 0, 0, 0, 0, 0]
    assert view.slot_mapping.tolist() == [100, 101, 102] + [-1] * 5
    assert view.seq_lens.tolist() == [5, 9, 17] + [0] * 5
    assert view.state_slots.tolist() == [0, 1, 2] + [-1] * 5
    assert view.block_tables[:3, :2].eq(7).all() and view.block_tables[3:].eq(0).all()
    assert view.cu_seqlens_q.tolist() == list(range(9))


def test_decode_capture_batch_of_a_stateful_model_has_state_slots():
    """Decode graphs are captured from an empty batch: its (empty) state slots must still
    select the static buffer, all padding (-1), or the Mamba mixer is captured without it."""
    registry = build_decode_registry(torch.device("cpu"), max_bs=4, max_blocks_per_seq=2,
                                     stateful=True)
    empty = build_batch([], [], 16, torch.device("cpu"), stateful=True)
    registry.fill_from(empty, raw_bs=0, padded_bs=4, raw_num_tokens=0, padded_num_tokens=4)
    view = registry.extract_buffer(padded_bs=4, padded_num_tokens=4, template=empty)
    assert view.state_slots.tolist() == [-1] * 4


def test_models_without_state_carry_no_state_slots():
    """Dense models neither build state slots on the host nor fill a static buffer."""
    registry = build_decode_registry(torch.device("cpu"), max_bs=8, max_blocks_per_seq=4)
    assert not registry.has_slot("state_slots")
    seq = SyntheticSequence([1, 2, 3], [0], state_slot=5)
    assert build_batch([seq], [3], 16, torch.device("cpu")).state_slots is None
    assert build_batch([seq], [3], 16, torch.device("cpu"), stateful=True).state_slots \
        .tolist() == [5]


def test_prefill_registry_zeroes_the_token_tail():
    registry = build_prefill_registry(torch.device("cpu"), max_num_tokens=16)
    poison_registry(registry, keep=WRITTEN_ONCE)
    batch = decode_batch([3, 4], blocks=1)
    registry.fill_from(batch, raw_bs=0, padded_bs=0, raw_num_tokens=2, padded_num_tokens=4)
    view = registry.extract_buffer(padded_bs=1, padded_num_tokens=4, template=batch)
    assert view.input_ids.tolist() == [10, 11, 0, 0]
    assert view.positions.tolist() == [2, 3, 0, 0]
    assert view.slot_mapping is batch.slot_mapping  # attention reads the live batch


def test_a_prefill_graph_captures_no_rotary_kv_store_even_at_one_token():
    """A prefill graph's segments serve decode and prefill batches alike, and its attention
    break stores the live batch's keys and values: a capture, even of a one-token bucket
    (whose batch looks like a decode), must not let rotary store them itself (into the
    capture's stand-in slots, the break then skipping its store on every replay)."""
    cpu = torch.device("cpu")
    backend = TritonAttention(num_heads=4, num_kv_heads=2, head_dim=8, device=cpu)
    cache = KVCache(1, 1, 16, 2, 8, torch.float32, cpu)
    runner = SimpleNamespace(block_size=16, device=cpu, stateful=False,
                             registry=build_prefill_registry(cpu, max_num_tokens=16),
                             make_context=lambda batch: ForwardContext(batch, cache, backend))
    for size in (1, 16):
        _, _, context = PrefillGraphRunner.capture_inputs(runner, size)
        v = torch.zeros(size, 2, 8)
        assert backend.kv_store_target(SimpleNamespace(layer_id=0), v, context) is None
