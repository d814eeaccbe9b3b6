"""The fused decode stack's host side, on any machine: which models it takes, how it tiles
them, and the switch that turns it off (the kernel itself: test_decode_stack_gpu.py)."""

import pytest
import torch
from torch import nn

import bcg.layers.decode_stack as decode_stack_layer
from bcg.kernels.decode_stack import StackShape, _constexprs, unsupported_reason
from bcg.layers.norm import RMSNorm
from bcg.utils import switch_from_environment

QWEN3_0_6B = StackShape(num_layers=28, hidden=1024, num_heads=16, num_kv_heads=8, head_dim=128,
                        intermediate=3072, qk_norm=True)


def test_qwen3_0_6b_cuts_into_one_tile_a_program_on_an_h100():
    assert unsupported_reason(QWEN3_0_6B, programs=132) is None
    c = _constexprs(QWEN3_0_6B, 132, (2, 28, 100, 16, 8, 128), True, 64, 64)
    # 128 tiles of 32 QKV columns, of 8 o and down columns; 128 gate/up tiles of 24 columns
    # (not 96 of 32), read as 32 with the last 8 masked.
    assert (c["QKV_TILE"], c["O_TILE"], c["GATE_UP_TILE"], c["DOWN_TILE"]) == (32, 8, 24, 8)
    assert c["GATE_UP_TILE_P2"] == 32
    # Chunks that divide each input size: at most 8192 weights, o's and gate/up's 16384
    # (gate/up's rows padded to a power of two).
    assert (c["QKV_CHUNK"], c["O_CHUNK"], c["GATE_UP_CHUNK"], c["DOWN_CHUNK"]) == (
        256, 2048, 256, 1024)
    assert (c["KV_LAYER_STRIDE"], c["V_OFFSET"]) == (100 * 16 * 8 * 128, 28 * 100 * 16 * 8 * 128)


def test_larger_models_run_their_layers_one_by_one():
    qwen3_8b = StackShape(num_layers=36, hidden=4096, num_heads=32, num_kv_heads=8,
                          head_dim=128, intermediate=12288, qk_norm=True)
    assert "qkv projection (6144 x 4096)" in unsupported_reason(qwen3_8b, programs=132)


def test_a_kv_cache_of_another_model_is_refused():
    with pytest.raises(ValueError, match="KV cache"):
        _constexprs(QWEN3_0_6B, 132, (2, 28, 100, 16, 4, 128), True, 64, 64)


def test_a_model_it_cannot_tile_is_named():
    odd_head = StackShape(num_layers=2, hidden=96, num_heads=4, num_kv_heads=2, head_dim=24,
                          intermediate=96, qk_norm=False)
    assert "power of two" in unsupported_reason(odd_head, programs=132)
    odd_hidden = StackShape(num_layers=2, hidden=100, num_heads=4, num_kv_heads=2, head_dim=32,
                            intermediate=96, qk_norm=False)
    assert "whole tiles" in unsupported_reason(odd_hidden, programs=132)
    narrow = StackShape(num_layers=2, hidden=64, num_heads=1, num_kv_heads=1, head_dim=128,
                        intermediate=96, qk_norm=True)
    assert "at least head_dim" in unsupported_reason(narrow, programs=132)


def test_the_stack_is_never_prepared_off_cuda():
    norm = RMSNorm(64, 1e-6).to(torch.bfloat16)
    stack = decode_stack_layer.FusedDecodeStack(nn.ModuleList(), norm, None)
    stack.prepare()
    assert stack._workspace is None
    assert not stack.runs(torch.zeros(1, 64, dtype=torch.bfloat16))


def test_its_switch_reads_like_bcg_pdl(monkeypatch):
    monkeypatch.setenv("BCG_DECODE_STACK", "0")
    assert switch_from_environment("BCG_DECODE_STACK") is False
    monkeypatch.setenv("BCG_DECODE_STACK", "maybe")
    with pytest.raises(ValueError, match="BCG_DECODE_STACK must be 1 or 0"):
        switch_from_environment("BCG_DECODE_STACK")
