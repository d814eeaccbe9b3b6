"""Bridge buffers: what crosses a graph break, shared by every layer of a runner (CPU)."""

import logging

import pytest
import torch

from bcg.engine.llm import LLM
from bcg.graph import BridgeBuffers, bridge_buffer, use_bridge_buffers
from tests.hf_tiny import VOCAB, PagedHarness, save_tiny_model
from tests.numerics import relative_error

CPU = torch.device("cpu")


def test_views_share_one_buffer_per_name_and_grow_when_too_small():
    bridges = BridgeBuffers()
    big = bridges.view("qkv", (8, 4), torch.float32, CPU)
    small = bridges.view("qkv", (3, 4), torch.float32, CPU)
    assert small.data_ptr() == big.data_ptr() and small.is_contiguous()
    other = bridges.view("out", (3, 4), torch.float32, CPU)
    assert other.data_ptr() != big.data_ptr()
    assert bridges.view("qkv", (3, 4), torch.bfloat16, CPU).dtype == torch.bfloat16
    grown = bridges.view("qkv", (16, 4), torch.float32, CPU)
    assert grown.shape == (16, 4)
    assert big.shape == (8, 4)  # an older view keeps its own (old) storage alive
    assert bridges.nbytes == 16 * 4 * 4 + 3 * 4 * 4 + 3 * 4 * 2


def test_bridge_buffer_is_none_outside_a_bridge_scope():
    assert bridge_buffer("qkv", (2, 2), torch.float32, CPU) is None
    bridges = BridgeBuffers()
    with use_bridge_buffers(bridges):
        inside = bridge_buffer("qkv", (2, 2), torch.float32, CPU)
    assert inside is not None and inside.data_ptr() == bridges.view(
        "qkv", (2, 2), torch.float32, CPU).data_ptr()
    assert bridge_buffer("qkv", (2, 2), torch.float32, CPU) is None


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_model_on_bridges_computes_what_it_computes_without(arch, tmp_path):
    """Every layer writes q, k, v and the attention output into the same two buffers: the
    result must not change (Qwen2's biased projection included)."""
    save_tiny_model(arch, tmp_path)
    harness = PagedHarness(tmp_path)
    prompts = [[(5 * i + j) % VOCAB for j in range(n)] for i, n in enumerate((9, 4, 17))]
    seqs = [harness.new_sequence(p) for p in prompts]
    for seq in seqs:
        assert harness.block_manager.try_allocate(seq, len(seq.token_ids))
    batch = harness.runner.prepare(seqs, [len(p) for p in prompts])
    with torch.inference_mode():
        plain = harness.runner.forward(batch).clone()
        bridges = BridgeBuffers()
        with use_bridge_buffers(bridges):
            bridged = harness.runner.forward(batch)
    assert bridges.nbytes > 0
    assert relative_error(bridged, plain) == 0


def test_start_up_breakdown_is_logged(tmp_path, caplog):
    save_tiny_model("qwen3", tmp_path)
    with caplog.at_level(logging.INFO):
        LLM(model=str(tmp_path), device="cpu", max_model_len=64)
    messages = [r.getMessage() for r in caplog.records]
    for step in ("weights (auto)", "KV cache sized and allocated"):
        assert any(f"start-up: {step} in" in m for m in messages), messages
    assert any(m.startswith("engine ready in ") for m in messages)
