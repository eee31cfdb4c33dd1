"""Submodules imported when first used as attributes (PEP 562), at every package level.

``import gpuload`` imports no submodule but the errors (so the command starts without
torch); ``gpuload.gpu.runtime.gpu_usable()`` still works after it, each package importing
its submodule ``name`` the first time ``package.name`` is asked for.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from types import ModuleType

__all__ = ["submodule_getattr"]


def submodule_getattr(package: str, path) -> Callable[[str], ModuleType]:
    """A module ``__getattr__`` for package ``package`` (its ``__name__``; ``path``: its
    ``__path__``) that imports its submodule ``name`` on first use; other names are
    ``AttributeError``."""

    def __getattr__(name: str) -> ModuleType:
        if not name.startswith("__") and any(m.name == name for m in pkgutil.iter_modules(path)):
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
