"""Names a package serves on first use (PEP 562's module ``__getattr__``), so importing one of its submodules (a
rank imports ``torch.rank``) loads neither pyspark.ml nor the framework's estimator."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, public: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``package.<public[name]>`` and returns its ``name``."""

    def __getattr__(name: str) -> Any:  # noqa: N807 - the module hook's own name
        if name in public:
            return getattr(importlib.import_module(f"{package}.{public[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
