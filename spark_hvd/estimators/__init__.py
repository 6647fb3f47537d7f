"""Spark ML estimators: ``TorchEstimator``/``TorchModel``, ``KerasEstimator``/``KerasModel`` and
``LightningEstimator``/``LightningModel``.

Nothing else in spark_hvd imports this package; it imports pyspark (and the framework) lazily per class.
``common/`` holds what the frameworks share, ``torch/``, ``keras/`` and ``lightning/`` what differs; the flat
layout's module names (``spark_hvd.estimators.rank_run`` ...) still import, as aliases (``_moved.py``), so
pickles and saved Pipelines that name them load.
"""

from __future__ import annotations

from typing import Any

from spark_hvd.estimators import _moved

_moved.install()

__all__ = ["TorchEstimator", "TorchModel", "KerasEstimator", "KerasModel", "LightningEstimator", "LightningModel"]


def __getattr__(name: str) -> Any:
    if name in ("TorchEstimator", "TorchModel"):
        from spark_hvd.estimators import torch as _torch

        return getattr(_torch, name)
    if name in ("KerasEstimator", "KerasModel"):
        from spark_hvd.estimators import keras as _keras

        return getattr(_keras, name)
    if name in ("LightningEstimator", "LightningModel"):
        from spark_hvd.estimators import lightning as _lightning

        return getattr(_lightning, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
