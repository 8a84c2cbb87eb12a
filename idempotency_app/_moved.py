"""Public names that moved, kept working for one more release.

Importing a module by its old path (``idempotency_app.keys``, as a settings
string may name it) gives the module at its new path and warns once with a
``DeprecationWarning`` naming it. ``IdempotencyConfig`` is not needed for
this: ``idempotency_app/__init__.py`` installs the finder.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any

# Old module path -> new module path.
MODULES = {
    "idempotency_app.keys": "idempotency_app.http.keys",
    "idempotency_app.work": "idempotency_app.lifecycle.work",
    "idempotency_app.openapi": "idempotency_app.integrations.openapi",
    "idempotency_app.metrics": "idempotency_app.integrations.metrics",
}
REMOVED_IN = "0.3"


def deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"{old} moved to {new}; the old name stops working in idempotency_app {REMOVED_IN}.",
        DeprecationWarning,
        stacklevel=3,
    )


class _Alias(types.ModuleType):
    """The old path: every attribute is the new module's."""

    def __getattr__(self, name: str) -> Any:
        return getattr(importlib.import_module(MODULES[self.__name__]), name)


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _Alias(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        deprecated(module.__name__, MODULES[module.__name__])


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in MODULES:
            return None
        return importlib.machinery.ModuleSpec(name, _Loader())


def install() -> None:
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
