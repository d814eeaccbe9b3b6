"""KV store, RMSNorm (+ residual), gated RMSNorm, rotary, SiLU-and-mul and squared-ReLU kernels
against the layers."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
import triton
import triton.language as tl
import triton.runtime.cache
from torch import nn

from bcg.graph import CaptureNeedsWarmUp, abandon_capture
from bcg.kernels import _launch as launch
from bcg.kernels._launch import CachedLauncher
from bcg.layers.activation import relu_squared as relu_squared_layer
from bcg.layers.activation import silu_and_mul as silu_and_mul_layer
from bcg.layers.attention_ref import store_kv as store_kv_ref
from bcg.layers.norm import GatedRMSNorm, RMSNorm
from bcg.layers.rotary import RotaryEmbedding
from tests.kernels_support import DEVICE, DTYPE, ON_GPU, TOLERANCE, import_kernels
from tests.numerics import relative_error

kv_store = import_kernels("kv_store")
rmsnorm = import_kernels("rmsnorm")
rotary = import_kernels("rotary")
activation = import_kernels("activation")

NUM_TOKENS = [1, 37, 1000] if ON_GPU else [1, 13]
LLAMA3_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def rand(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(DTYPE).to(DEVICE)


def reference(layer: nn.Module) -> nn.Module:
    """An fp32 CPU copy of `layer`: its PyTorch reference path, even on a GPU machine (on
    CUDA the layer itself would call the kernel under test)."""
    return copy.deepcopy(layer).to("cpu", torch.float32)


def cpu32(x: torch.Tensor) -> torch.Tensor:
    return x.detach().float().cpu()


def fused_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, seed: int):
    """q, k, v as strided views into one projection output, as a fused qkv linear gives."""
    generator = torch.Generator().manual_seed(seed)
    qkv = rand(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    return (q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim),
            v.view(num_tokens, num_kv_heads, head_dim))


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("head_shape", [(4, 64, 16), (8, 128, 16), (1, 64, 32)], ids=str)
def test_store_kv_matches_reference(num_tokens: int, head_shape: tuple) -> None:
    num_kv_heads, head_dim, block_size = head_shape
    _, k, v = fused_qkv(num_tokens, num_kv_heads, num_kv_heads, head_dim, seed=num_tokens)
    num_blocks = num_tokens // block_size + 4
    generator = torch.Generator().manual_seed(1)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[::3] = -1  # padding tokens
    slots = slots.to(DEVICE)
    caches = [rand(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
              for _ in range(2)]
    expected = [c.clone() for c in caches]
    kv_store.store_kv(k, v, *caches, slots)
    store_kv_ref(k, v, *expected, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("hidden", [64, 1000, 4096])
def test_rms_norm_matches_layer(num_tokens: int, hidden: int) -> None:
    generator = torch.Generator().manual_seed(hidden)
    layer = RMSNorm(hidden, eps=1e-6).to(DEVICE, DTYPE)
    layer.weight.copy_(rand(hidden, generator=generator))
    x = rand(num_tokens, hidden, generator=generator)
    out = rmsnorm.rms_norm(x, layer.weight, layer.eps)
    assert relative_error(out, reference(layer)(cpu32(x))) <= TOLERANCE


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_add_rms_norm_matches_layer(num_tokens: int) -> None:
    generator = torch.Generator().manual_seed(num_tokens)
    hidden = 1024
    layer = RMSNorm(hidden, eps=1e-5).to(DEVICE, DTYPE)
    layer.weight.copy_(rand(hidden, generator=generator))
    x, residual = rand(num_tokens, hidden, generator=generator), rand(
        num_tokens, hidden, generator=generator)
    expected_out, expected_residual = reference(layer).add_and_norm(cpu32(x), cpu32(residual))
    out, new_residual = rmsnorm.add_rms_norm(x, residual, layer.weight, layer.eps)
    assert new_residual is residual
    assert relative_error(residual, expected_residual) <= TOLERANCE
    assert relative_error(out, expected_out) <= TOLERANCE


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("top_k,hidden", [(8, 2048), (3, 600)] if ON_GPU else [(3, 96), (1, 40)])
def test_sum_add_rms_norm_is_the_sum_then_add_rms_norm(num_tokens: int, top_k: int,
                                                       hidden: int) -> None:
    """A mixture-of-experts token's expert outputs summed (fp32, rounded once), added to
    the residual and normalised in one launch: as the sum, then `add_rms_norm`."""
    generator = torch.Generator().manual_seed(num_tokens + top_k)
    weight = rand(hidden, generator=generator)
    rows = rand(num_tokens, top_k, hidden, generator=generator)
    residual = rand(num_tokens, hidden, generator=generator)
    summed = rows.float().sum(dim=1).to(DTYPE)
    expected_out, expected_residual = rmsnorm.add_rms_norm(summed, residual.clone(), weight,
                                                           1e-6)
    out, new_residual = rmsnorm.sum_add_rms_norm(rows, residual, weight, 1e-6)
    assert new_residual is residual
    # bf16: the eight rows may sum in another order than PyTorch's, an ulp apart at most
    assert relative_error(residual, expected_residual) <= (1e-2 if ON_GPU else 1e-6)
    assert relative_error(out, expected_out) <= (1e-2 if ON_GPU else 1e-6)


def test_sum_add_rms_norm_names_what_it_takes() -> None:
    rows = torch.zeros(2, 3, 8, device=DEVICE, dtype=DTYPE)
    with pytest.raises(ValueError, match=r"residual \[tokens, hidden\]"):
        rmsnorm.sum_add_rms_norm(rows, torch.zeros(2, 9, device=DEVICE, dtype=DTYPE),
                                 torch.ones(8, device=DEVICE, dtype=DTYPE), 1e-6)


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("width,group_size", [(256, 64), (1024, 1024), (384, 96)], ids=str)
def test_gated_rms_norm_matches_layer(num_tokens: int, width: int, group_size: int) -> None:
    """Mamba2's output norm, its gate a strided view into the projection (as in the mixer)."""
    generator = torch.Generator().manual_seed(width + group_size)
    layer = GatedRMSNorm(width, group_size, eps=1e-5, local_size=width).to(DEVICE, DTYPE)
    layer.weight.copy_(rand(width, generator=generator))
    projected = rand(num_tokens, 3 * width, generator=generator)
    gate = projected[:, width : 2 * width]
    x = rand(num_tokens, width, generator=generator)
    out = rmsnorm.gated_rms_norm(x, gate, layer.weight, group_size, layer.eps)
    assert relative_error(out, reference(layer)(cpu32(x), cpu32(gate))) <= TOLERANCE


def test_gated_rms_norm_rejects_a_width_not_in_groups() -> None:
    x = torch.zeros(2, 100, device=DEVICE, dtype=DTYPE)
    with pytest.raises(ValueError, match="multiple of 64"):
        rmsnorm.gated_rms_norm(x, x, x[0], 64, 1e-5)


def test_per_head_rms_norm_on_strided_view() -> None:
    """Qwen3's q/k norm: per-head RMSNorm over a view into the fused qkv output."""
    q, _, _ = fused_qkv(NUM_TOKENS[-1], 8, 2, 128, seed=4)
    layer = RMSNorm(128, eps=1e-6).to(DEVICE, DTYPE)
    layer.weight.copy_(rand(128, generator=torch.Generator().manual_seed(2)))
    expected = reference(layer)(cpu32(q))
    rmsnorm.rms_norm(q, layer.weight, layer.eps, out=q)
    assert relative_error(q, expected) <= TOLERANCE


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["default", "llama3"])
@pytest.mark.parametrize("head_shape", [(8, 2, 128), (4, 4, 64), (12, 4, 64)], ids=str)
def test_rotary_matches_layer(head_shape: tuple, scaling: dict | None) -> None:
    num_heads, num_kv_heads, head_dim = head_shape
    num_tokens, max_position = NUM_TOKENS[-1], 4096
    layer = RotaryEmbedding(head_dim, max_position, 500000.0, scaling).to(DEVICE)
    q, k, _ = fused_qkv(num_tokens, num_heads, num_kv_heads, head_dim, seed=head_dim)
    generator = torch.Generator().manual_seed(0)
    positions = torch.randint(0, max_position, (num_tokens,), generator=generator).to(DEVICE)
    expected_q, expected_k = reference(layer)(positions.cpu(), cpu32(q), cpu32(k))
    rotary.apply_rotary(q, k, positions, layer.cos, layer.sin)
    assert relative_error(q, expected_q) <= TOLERANCE
    assert relative_error(k, expected_k) <= TOLERANCE


@pytest.mark.parametrize("head_shape", [(8, 2, 128), (12, 4, 64)], ids=str)
def test_rotary_with_qk_norm_matches_layers(head_shape: tuple) -> None:
    num_heads, num_kv_heads, head_dim = head_shape
    num_tokens, max_position = NUM_TOKENS[-1], 4096
    layer = RotaryEmbedding(head_dim, max_position, 1000000.0).to(DEVICE)
    q_norm, k_norm = (RMSNorm(head_dim, 1e-6).to(DEVICE, DTYPE) for _ in range(2))
    generator = torch.Generator().manual_seed(1)
    for norm in (q_norm, k_norm):
        norm.weight.copy_(torch.rand(head_dim, generator=generator) + 0.5)
    q, k, _ = fused_qkv(num_tokens, num_heads, num_kv_heads, head_dim, seed=head_dim)
    positions = torch.randint(0, max_position, (num_tokens,), generator=generator).to(DEVICE)
    normed_q, normed_k = reference(q_norm)(cpu32(q)), reference(k_norm)(cpu32(k))
    expected_q, expected_k = reference(layer)(positions.cpu(), normed_q, normed_k)
    weights = (q_norm.weight, k_norm.weight)
    rotary.apply_rotary(q, k, positions, layer.cos, layer.sin, weights, q_norm.eps)
    assert relative_error(q, expected_q) <= TOLERANCE
    assert relative_error(k, expected_k) <= TOLERANCE


@pytest.mark.parametrize("norms", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("head_shape", [(8, 2, 128), (12, 3, 64)], ids=str)
def test_rotary_storing_kv_equals_rotary_then_store(head_shape: tuple, norms: bool) -> None:
    """The decode path's fused launch: the same q, k and caches as rotary and then store_kv,
    bit for bit; padding slots (-1) write nothing."""
    num_heads, num_kv_heads, head_dim = head_shape
    num_tokens, block_size, max_position = NUM_TOKENS[-1], 16, 4096
    layer = RotaryEmbedding(head_dim, max_position, 1000000.0).to(DEVICE)
    generator = torch.Generator().manual_seed(5)
    weights = tuple(rand(head_dim, generator=generator) for _ in range(2)) if norms else None
    positions = torch.randint(0, max_position, (num_tokens,), generator=generator).to(DEVICE)
    num_blocks = num_tokens // block_size + 2
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[::2] = -1
    slots = slots.to(DEVICE)
    caches = [rand(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
              for _ in range(2)]
    q, k, v = fused_qkv(num_tokens, num_heads, num_kv_heads, head_dim, seed=7)
    fused_q, fused_k = q.clone(), k.clone()
    fused_caches = [c.clone() for c in caches]
    rotary.apply_rotary(q, k, positions, layer.cos, layer.sin, weights, 1e-6)
    kv_store.store_kv(k, v, *caches, slots)
    rotary.apply_rotary(fused_q, fused_k, positions, layer.cos, layer.sin, weights, 1e-6,
                        kv_store=(v, *fused_caches, slots))
    assert torch.equal(fused_q, q) and torch.equal(fused_k, k)
    assert torch.equal(fused_caches[0], caches[0]) and torch.equal(fused_caches[1], caches[1])


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("intermediate", [64, 1000, 3072])
def test_silu_and_mul_matches_layer(num_tokens: int, intermediate: int) -> None:
    x = rand(num_tokens, 2 * intermediate, generator=torch.Generator().manual_seed(3))
    out = activation.silu_and_mul(x)
    assert relative_error(out, silu_and_mul_layer(cpu32(x))) <= TOLERANCE


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("width", [64, 1000, 3072])
def test_relu_squared_matches_layer_in_place(num_tokens: int, width: int) -> None:
    x = rand(num_tokens, width, generator=torch.Generator().manual_seed(width))
    expected = relu_squared_layer(cpu32(x))
    out = activation.relu_squared(x, out=x)
    assert out is x
    assert relative_error(out, expected) <= TOLERANCE


@triton.jit
def _fill_kernel(out_ptr, value, SIZE: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, SIZE), value)


def test_the_launchers_rules_hold_under_the_interpreter_too() -> None:
    """An integer runtime argument must be do_not_specialize, and constexprs come in
    signature order: checked on the CPU as on a GPU (a kernel that broke the first rule
    once passed every CPU test and failed at its first launch on a GPU)."""
    out = torch.zeros(4, device=DEVICE)
    with pytest.raises(TypeError, match="integer argument 1 must be a constexpr or listed"):
        CachedLauncher(_fill_kernel)((1,), (out,), (7,), {"SIZE": 4})
    CachedLauncher(_fill_kernel)((1,), (out,), (7.0,), {"SIZE": 4})  # a float specialises not
    assert out.tolist() == [7.0] * 4


@pytest.mark.gpu
def test_cached_launch_tells_alignments_apart() -> None:
    """A kernel compiled for 16-byte aligned pointers must not serve a misaligned view."""
    rows, width = 7, 256
    flat = rand(rows * width + 1, generator=torch.Generator().manual_seed(8))
    aligned, misaligned = flat[:-1].view(rows, width), flat[1:].view(rows, width)
    for x in (aligned, misaligned, aligned, misaligned):
        assert relative_error(activation.silu_and_mul(x), silu_and_mul_layer(cpu32(x))) <= TOLERANCE


@pytest.mark.gpu
def test_a_new_variant_under_capture_asks_for_a_warm_up(monkeypatch) -> None:
    """A capture cannot load a kernel: a variant's first launch during capture raises
    before recording anything, and once launched eagerly the same call captures."""
    fresh = CachedLauncher(activation._silu_and_mul_kernel)
    monkeypatch.setattr(activation, "_launch_silu_and_mul", fresh)
    x = rand(5, 128, generator=torch.Generator().manual_seed(9))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin()
        with pytest.raises(CaptureNeedsWarmUp, match="_silu_and_mul_kernel"):
            activation.silu_and_mul(x)
        abandon_capture(graph)
        expected = activation.silu_and_mul(x)
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin()
        out = activation.silu_and_mul(x)
        graph.capture_end()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


def test_triton_hashes_itself_once_in_the_background(monkeypatch) -> None:
    """Start-up hashes Triton's files in a thread; a kernel's first launch waits for that
    thread instead of hashing a second time."""
    hashed = []

    def slow_triton_key() -> None:
        time.sleep(0.05)
        hashed.append(threading.current_thread().name)

    monkeypatch.setattr(triton.runtime.cache, "triton_key", slow_triton_key)
    monkeypatch.setattr(launch, "_triton_hashing", None)
    launch.hash_triton_in_background()
    fresh = CachedLauncher(activation._silu_and_mul_kernel)
    monkeypatch.setattr(activation, "_launch_silu_and_mul", fresh)
    activation.silu_and_mul(rand(3, 128, generator=torch.Generator().manual_seed(4)))
    assert hashed == ["triton-key"]
