"""Programmatic dependent launch (`bcg.kernels._pdl`): a chain of norms and skinny
projections, each reading what the one before wrote (and the norms updating the residual in
place), gives bit for bit the same launched early in a CUDA graph as launched plainly; off
the GPU, and with BCG_PDL=0, nothing launches early."""

from __future__ import annotations

import pytest
import torch

from tests.kernels_support import DEVICE, DTYPE, ON_GPU, import_kernels

pdl = import_kernels("_pdl")
rmsnorm = import_kernels("rmsnorm")
skinny = import_kernels("skinny_linear")

HIDDEN, INTERMEDIATE, LAYERS, ROWS = (1024, 3072, 6, 3) if ON_GPU else (32, 48, 2, 3)


def test_nothing_launches_early_off_the_gpu():
    assert not pdl.launches_early(torch.device("cpu"))


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setattr(pdl, "SWITCHED_ON", False)
    assert not pdl.launches_early(DEVICE)


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("On", True), (" no ", False),
                                       ("0", False), ("false", False)])
def test_the_switch_reads_the_usual_spellings(value, on):
    assert pdl.switch_from_environment(value) is on


def test_a_bad_switch_value_is_refused_with_the_accepted_ones():
    with pytest.raises(ValueError, match="BCG_PDL must be 1 or 0"):
        pdl.switch_from_environment("2")


def chain(x: torch.Tensor, residual: torch.Tensor, weights: list) -> torch.Tensor:
    """Pre-norm MLP blocks: add + norm, gate/up with SiLU-and-mul, down."""
    for norm_weight, gate_up, down in weights:
        normed, residual = rmsnorm.add_rms_norm(x, residual, norm_weight, 1e-6)
        x = skinny.skinny_linear(skinny.skinny_linear(normed, gate_up, activation="silu_and_mul"),
                                 down)
    return x


@pytest.mark.skipif(not ON_GPU or not pdl.launches_early(DEVICE),
                    reason="needs a GPU with programmatic dependent launch")
def test_a_chain_launched_early_in_a_graph_matches_plain_launches(monkeypatch):
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.05).to(DTYPE).to(DEVICE)

    weights = [(rand(HIDDEN) + 1, rand(2 * INTERMEDIATE, HIDDEN), rand(HIDDEN, INTERMEDIATE))
               for _ in range(LAYERS)]
    x, residual = rand(ROWS, HIDDEN), rand(ROWS, HIDDEN)
    monkeypatch.setattr(pdl, "SWITCHED_ON", False)
    expected_residual = residual.clone()
    expected = chain(x, expected_residual, weights)
    monkeypatch.setattr(pdl, "SWITCHED_ON", True)
    graph_residual = residual.clone()
    chain(x, graph_residual, weights)  # compiles the early-launched variants
    graph = torch.cuda.CUDAGraph()
    graph_residual.copy_(residual)
    with torch.cuda.graph(graph):
        out = chain(x, graph_residual, weights)
    for _ in range(3):
        graph_residual.copy_(residual)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected) and torch.equal(graph_residual, expected_residual)
