"""Names of a package loaded on first use (PEP 562 module `__getattr__` / `__dir__`).

`vpaged.hf` and `vpaged.serve` export names whose modules import transformers; loading them lazily lets the
CLI and `vpaged info` read the light modules of those packages (the engine's options, the transformers
compatibility table) without importing transformers.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_names(package: str, names: Mapping[str, str], namespace: dict) -> tuple[Callable, Callable]:
    """The `__getattr__` and `__dir__` of `package`, whose public name N lives in submodule `names[N]`.
    A loaded name is stored in `namespace` (the package's globals), so it is looked up once."""

    def __getattr__(name: str):
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
