"""Random weights, for benchmarks and tests that need the shapes but not the values."""

from __future__ import annotations

import zlib

import torch
from torch import nn

from bcg.layers.norm import GatedRMSNorm, RMSNorm


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Normal(0, std) weights and biases, ones for norm scales, drawn on the parameters'
    device (an 8B model on the CPU would take minutes). Each tensor is drawn whole, as a
    checkpoint holds it, from a generator seeded by `seed` and its name, and a layer split
    over tensor-parallel ranks keeps its rank's part: every split gets the same model."""
    device = next(model.parameters()).device
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # a tied weight
                continue
            seen.add(id(param))
            name = f"{module_name}.{param_name}"

            def draw(shape: tuple[int, ...], part: int = 0, name: str = name,
                     dtype: torch.dtype = param.dtype) -> torch.Tensor:
                # In the parameter's dtype: no fp32 temporary twice its size.
                key = zlib.crc32(f"{seed}:{name}:{part}".encode())
                generator = torch.Generator(device=device).manual_seed(key)
                return torch.empty(shape, device=device, dtype=dtype).normal_(
                    0.0, std, generator=generator)

            if isinstance(module, (RMSNorm, GatedRMSNorm)):
                param.fill_(1.0)
            elif hasattr(module, "fill_dummy"):
                module.fill_dummy(name, draw)
            else:
                # A module that cuts checkpoint tensors per rank must draw them whole.
                assert not hasattr(module, "load_weight"), f"{type(module).__name__}.fill_dummy"
                param.copy_(draw(tuple(param.shape)))
