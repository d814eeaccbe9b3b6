"""Builds the model of a `ModelSource` directly on its device and dtype, then fills it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from bcg.loader.dummy import fill_dummy_weights
from bcg.loader.model_source import ModelSource
from bcg.models.base import CausalLM
from bcg.models.registry import model_class


def load_model(
    source: ModelSource, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> CausalLM:
    cls = model_class(source.config.architecture)
    with torch.device(device), _default_dtype(dtype):
        model = cls(source.config)
    if source.weights is None:
        fill_dummy_weights(model, seed)
    else:
        _load_checkpoint(model, source)
    model.process_weights_after_loading()
    return model.eval()


def _load_checkpoint(model: CausalLM, source: ModelSource) -> None:
    try:
        model.load_weights(source.weights())
    except ValueError as error:
        if not source.hf_overrides:
            raise
        raise ValueError(f"{error} (hf_overrides {source.hf_overrides} changed the config: "
                         "weights that no longer fit it load only as --load-format dummy)"
                         ) from error


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
