"""The interface every model implements; graph runners rely on nothing else.

- `forward(input_ids, positions)` is the transformer stack: token embedding in, final-norm
  hidden states out. Every op in it is token-wise except attention, so a graph captured
  for N tokens serves any batch of N tokens.
- `compute_logits(hidden_states)` is the head, run only on the rows to sample.
- `load_weights(named_tensors)` takes Hugging Face parameter names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
from torch import nn

from bcg.layers.linear import Linear, copy_checked
from bcg.layers.norm import RMSNorm
from bcg.models.config import ModelConfig


def run_residual_stack(layers: nn.ModuleList, positions: torch.Tensor,
                       hidden_states: torch.Tensor, final_norm: RMSNorm) -> torch.Tensor:
    """Pre-norm layers (each with an `input_layernorm`), then the final norm of their sum.
    A layer is called `(positions, normed, residual, next_norm) -> (normed, residual)`: it
    takes its input normed, adds its output to the residual and normalises the sum with
    the norm after it (the next layer's input norm, or `final_norm`), so a tensor-parallel
    all-reduce, the add and the norm can run as one kernel."""
    norms_after = [layer.input_layernorm for layer in layers[1:]] + [final_norm]
    hidden_states, residual = layers[0].input_layernorm.add_and_norm(hidden_states, None)
    for layer, next_norm in zip(layers, norms_after, strict=True):
        hidden_states, residual = layer(positions, hidden_states, residual, next_norm)
    return hidden_states


class CausalLM(nn.Module, ABC):
    # Checkpoint projection name -> (our merged projection, shard index).
    packed_modules: dict[str, tuple[str, int]] = {}

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`[T]` token ids and positions -> `[T, hidden]` final hidden states."""

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[S, hidden]` -> `[S, vocab]` logits."""

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """Let layers derive what they keep from their weights, once they are loaded."""
        for module in self.modules():
            if module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()

    def ignores_weight(self, name: str) -> bool:
        """Checkpoint entries that have no parameter here (e.g. a head tied to the embedding)."""
        return False

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into the parameters; raise if any parameter is left unset."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        expected = self._expected_weight_keys(modules, params)
        loaded = set()
        for name, tensor in named_tensors:
            if self.ignores_weight(name):
                continue
            key = self._load_one(name, tensor, modules, params)
            loaded.add(key)
        missing = sorted(self._checkpoint_name(name, block) for name, block in expected - loaded)
        if missing:
            raise ValueError(
                f"the checkpoint lacks {len(missing)} weights: {', '.join(missing[:8])}"
            )

    def _checkpoint_name(self, name: str, block: int | None) -> str:
        """The checkpoint's name of parameter `name` (block `block` of a merged projection:
        `layers.0.mlp.gate_up_proj.weight` block 1 is `layers.0.mlp.up_proj.weight`)."""
        if block is None:
            return name
        module_path, _, param_name = name.rpartition(".")
        prefix, _, merged = module_path.rpartition(".")
        leaf = next(leaf for leaf, packed in self.packed_modules.items()
                    if packed == (merged, block))
        return f"{prefix}.{leaf}.{param_name}"

    def _load_one(self, name: str, tensor: torch.Tensor, modules: dict, params: dict):
        """Load one checkpoint tensor (each parallel layer takes its rank's part)."""
        module_path, _, param_name = name.rpartition(".")
        prefix, _, leaf = module_path.rpartition(".")
        if leaf in self.packed_modules:
            merged, block = self.packed_modules[leaf]
            modules[f"{prefix}.{merged}"].load_weight(name, tensor, block)
            return (f"{prefix}.{merged}.{param_name}", block)
        if name not in params:
            raise ValueError(f"unexpected weight {name!r} for {self.config.architecture}")
        module = modules[module_path]
        if hasattr(module, "load_weight"):
            module.load_weight(name, tensor)
        else:
            copy_checked(name, params[name], tensor)
        return (name, None)

    def _expected_weight_keys(self, modules: dict, params: dict) -> set:
        merged = {m for m, _ in self.packed_modules.values()}
        keys = set()
        for name in params:
            module_path, _, param_name = name.rpartition(".")
            module = modules[module_path]
            if module_path.rpartition(".")[2] in merged and isinstance(module, Linear):
                keys.update((name, shard) for shard in range(len(module.output_sizes)))
            else:
                keys.add((name, None))
        return keys
