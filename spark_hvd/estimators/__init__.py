"""Spark ML estimators: ``TorchEstimator``/``TorchModel`` (and ``KerasEstimator``/``KerasModel``).

Nothing else in spark_hvd imports this package; it imports pyspark (and the framework) lazily per class.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TorchEstimator", "TorchModel", "KerasEstimator", "KerasModel"]


def __getattr__(name: str) -> Any:
    if name in ("TorchEstimator", "TorchModel"):
        from spark_hvd.estimators import torch as _torch

        return getattr(_torch, name)
    if name in ("KerasEstimator", "KerasModel"):
        from spark_hvd.estimators import keras as _keras

        return getattr(_keras, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
