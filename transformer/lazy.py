"""Faces that import nothing until a name is used (PEP 562 module `__getattr__`).

A package whose modules pull in JAX or matplotlib, but whose face a light caller imports (the sweep
parent reaches `train.signals`; the report's statistics need no matplotlib), names each export's
module here instead of importing it: `from transformer.train import Trainer` imports
`transformer.train.trainer` then, and `import transformer.train` alone imports nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def exports(package: str, modules: dict[str, tuple[str, ...]]) -> tuple[list[str], Callable[[str], Any]]:
    """(`__all__`, `__getattr__`) of `package`'s face, from {submodule: names it exports}."""
    where = {name: module for module, names in modules.items() for name in names}
    clashes = sorted(set(where) & set(modules))
    assert not clashes, f"{package}: exported names that are also submodules shadow them: {clashes}"

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{where[name]}"), name)

    return sorted(where), __getattr__
