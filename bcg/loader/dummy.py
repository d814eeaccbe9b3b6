"""Random weights, for benchmarks and tests that need the shapes but not the values."""

from __future__ import annotations

import torch
from torch import nn

from bcg.layers.norm import RMSNorm


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Normal(0, std) weights and biases, ones for norm scales; deterministic per seed and
    device. Drawn on the parameters' device: an 8B model on the CPU would take minutes."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if isinstance(module, RMSNorm):
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=generator)
