"""Names a package loads on first use (PEP 562), so importing it never imports an optional
engine: ``parallax.ps``, ``parallax.rpc`` and ``parallax.tf`` keep their Ray-backed names
here, and ``import parallax`` never imports ray."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def loader(package: str, names: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` that imports ``names[name]`` (a module path) on first use.

    Example:
      >>> __getattr__ = loader("mypkg", {"sqrt": "math"})
      >>> __getattr__("sqrt")(4.0)
      2.0
    """

    def __getattr__(name: str):
        if name in names:
            return getattr(importlib.import_module(names[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
