"""Field types of the configuration dataclasses, checked from their annotations and metadata.

``check_fields(obj)`` checks every field of a dataclass instance: its type against the
annotation (:func:`type_ok`: ``bool`` is not an ``int``, an ``int`` is a ``float``, ``X | None``
admits None, lists and tuples element by element) and its range against the field's metadata
(``min``/``max`` inclusive, ``positive`` > 0, ``choices``).  ``seco_lab.config`` checks its
dataclasses with it and ``seco_lab.cli`` builds the ``seco-lab train`` flags from the same
annotations (:func:`unwrap_optional`), so the two read a field's type one way.
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import fields

__all__ = ["check_fields", "is_dataclass_type", "type_name", "type_ok", "unwrap_optional"]


def unwrap_optional(hint) -> tuple[object, bool]:
    """(the type inside ``X | None``, True) or (``hint``, False)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True
    return hint, False


def type_ok(value, hint) -> bool:
    """Does ``value`` have type ``hint`` (bool is not an int; an int is a float; lists/tuples element-wise)?"""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(type_ok(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(type_ok(v, args[0]) for v in value)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    return isinstance(value, hint)


def type_name(hint) -> str:
    """``hint`` as it is written in Python, for messages."""
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")


def check_fields(obj, prefix: str = "", skip_ranges: bool = False) -> None:
    """Type and range of every field of a dataclass instance, from its annotations and metadata."""
    hints = typing.get_type_hints(type(obj))
    for f in fields(obj):
        value, name = getattr(obj, f.name), prefix + f.name
        if is_dataclass_type(hints[f.name]):
            continue
        if not type_ok(value, hints[f.name]):
            raise ValueError(f"{name} must be {type_name(hints[f.name])}, got {value!r} ({type(value).__name__})")
        if skip_ranges or value is None or isinstance(value, (bool, str, list, tuple, dict)):
            if isinstance(value, str) and "choices" in f.metadata and value not in f.metadata["choices"]:
                raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(f.metadata['choices'])}")
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value}")
        meta = f.metadata
        if meta.get("positive") and not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
        if "min" in meta and value < meta["min"]:
            raise ValueError(f"{name} must be >= {meta['min']}, got {value}")
        if "max" in meta and value > meta["max"]:
            raise ValueError(f"{name} must be <= {meta['max']}, got {value}")


def is_dataclass_type(hint) -> bool:
    """A nested dataclass field (checked on its own, with its own fields)."""
    return isinstance(hint, type) and hasattr(hint, "__dataclass_fields__")
