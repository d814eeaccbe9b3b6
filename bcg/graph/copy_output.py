"""Write a break's fresh result into its capture-time result, in place.

Later graph segments captured the addresses of the capture-time result, so a break
that returns new tensors at replay must copy them there rather than hand them back.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch


def copy_output(dst: Any, src: Any) -> Any:
    """Copy `src` into `dst` in place where it holds tensors; return the updated `dst`.

    Tensors are copied in place (shapes must match). Tuples, lists, NamedTuples and
    dicts recurse element-wise and keep their container type. Dataclasses and plain
    objects get tensor attributes copied in place and other attributes set. Anything
    else returns `src`.
    """
    if isinstance(dst, torch.Tensor):
        return _copy_tensor(dst, src)
    if isinstance(dst, tuple):
        return _copy_tuple(dst, src)
    if isinstance(dst, list):
        dst[:] = [copy_output(d, s) for d, s in _zip_same_length(dst, src)]
        return dst
    if isinstance(dst, dict):
        return _copy_dict(dst, src)
    if _has_attributes(dst) and type(src) is type(dst):
        return _copy_attributes(dst, src)
    return src


def _copy_tensor(dst: torch.Tensor, src: Any) -> torch.Tensor:
    if not isinstance(src, torch.Tensor):
        raise TypeError(
            f"copy_output: the capture-time result is a tensor but the replay returned "
            f"{type(src).__name__}; a break must return the same structure every time"
        )
    if dst.shape != src.shape:
        raise ValueError(
            f"copy_output: shape mismatch, capture-time result {tuple(dst.shape)} vs replay "
            f"result {tuple(src.shape)}; a break must return the same shapes at capture and "
            f"replay (or write into a preallocated output and return None)"
        )
    if dst.data_ptr() != src.data_ptr():
        dst.copy_(src)
    return dst


def _zip_same_length(dst, src):
    if len(dst) != len(src):
        raise ValueError(
            f"copy_output: capture-time result has {len(dst)} elements, replay result has "
            f"{len(src)}; a break must return the same structure every time"
        )
    return zip(dst, src, strict=True)


def _copy_tuple(dst: tuple, src: Any) -> tuple:
    items = [copy_output(d, s) for d, s in _zip_same_length(dst, src)]
    if hasattr(dst, "_fields"):  # NamedTuple: rebuild through its own constructor
        return type(dst)(*items)
    return type(dst)(items)


def _copy_dict(dst: dict, src: dict) -> dict:
    if dst.keys() != src.keys():
        raise ValueError(
            f"copy_output: capture-time keys {sorted(map(str, dst))} differ from replay keys "
            f"{sorted(map(str, src))}"
        )
    for key in dst:
        dst[key] = copy_output(dst[key], src[key])
    return dst


def _has_attributes(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) or hasattr(obj, "__dict__")


def _attribute_names(obj: Any) -> list[str]:
    if dataclasses.is_dataclass(obj):
        return [f.name for f in dataclasses.fields(obj)]
    return list(vars(obj))


def _copy_attributes(dst: Any, src: Any) -> Any:
    for name in _attribute_names(src):
        new = getattr(src, name)
        old = getattr(dst, name, None)
        if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
            _copy_tensor(old, new)
        else:
            object.__setattr__(dst, name, new)  # also works for frozen dataclasses
    return dst


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors `copy_output` would reach in `value`: itself, or inside tuples, lists,
    dicts and objects' attributes (each object visited once, so cycles end)."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()

    def visit(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif id(item) in seen or isinstance(item, str | bytes | int | float | enum.Enum):
            return
        elif isinstance(item, list | tuple | dict):
            seen.add(id(item))
            for element in item.values() if isinstance(item, dict) else item:
                visit(element)
        elif _has_attributes(item) and not isinstance(item, type):
            seen.add(id(item))
            for name in _attribute_names(item):
                visit(getattr(item, name, None))

    visit(value)
    return found
