"""Lazy package fronts (PEP 562): a package's public names, imported from their modules on first use.

A study package's ``__init__`` re-exports its modules' public names; imported eagerly, ``seco-lab study NAME
--help`` paid for torch, scipy and pandas (3-5 s) to print its options.  With :func:`lazy_exports`, importing
the package (or one light module of it, e.g. its ``options``) costs nothing, and ``package.NAME`` or
``from package import NAME`` imports NAME's module then, once::

    __getattr__, __dir__ = lazy_exports(__name__, {".cell": ["Cell", "load_cell"], ".driver": ["main"]})
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

__all__ = ["lazy_exports"]


def lazy_exports(package: str, modules: dict[str, list[str]]) -> tuple[Callable, Callable]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package`` for the names each relative module exports.
    A name exported twice is a mistake in the table (ValueError)."""
    where: dict[str, str] = {}
    for module, names in modules.items():
        for name in names:
            if name in where:
                raise ValueError(f"{package}: {name!r} is exported by both {where[name]} and {module}")
            where[name] = module

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name], package), name)
        setattr(sys.modules[package], name, value)  # later look-ups do not come here again
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__
