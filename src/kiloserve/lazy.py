"""Lazy re-exports for package ``__init__`` files.

A package ``__init__`` imports nothing eagerly (docs/architecture.md): importing one
module of a package must load only what that module needs. To keep the short public
names (``from kiloserve.workload import load_workload``), a package maps each name to
its home module and resolves it on first access::

    _HOMES = {"load_workload": "kiloserve.workload.loader"}
    __getattr__, __dir__ = lazy_exports(__name__, __all__, _HOMES)

with the same imports under ``if TYPE_CHECKING:`` for the type checker.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, public: Sequence[str], homes: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module ``__getattr__`` and ``__dir__`` for ``package`` that import each name of
    ``homes`` (name -> module) on first access. ``public`` is the package's ``__all__``:
    every public name must have a home (checked here, at import time)."""
    missing = sorted(set(public) - set(homes))
    if missing:
        raise ImportError(f"{package}: no home module for {', '.join(missing)}")

    def getattr_(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(home), name)

    def dir_() -> list[str]:
        return sorted({*public, *importlib.import_module(package).__dict__})

    return getattr_, dir_
