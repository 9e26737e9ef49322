"""A package's names imported when first used (PEP 562), so that importing one light submodule — the
upload process imports the object store and nothing of PyTorch — does not import the whole package."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["exports"]


def exports(package: str, where: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose name ``n`` is ``where[n]``'s (a
    submodule, relative to the package) — imported at its first use, then kept in the package."""
    namespace = importlib.import_module(package).__dict__

    def getattr_(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *where})

    return getattr_, dir_
