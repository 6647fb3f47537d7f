"""Spark ML estimators: ``TorchEstimator``/``TorchModel``, ``KerasEstimator``/``KerasModel`` and
``LightningEstimator``/``LightningModel``.

Nothing else in spark_hvd imports this package; it imports pyspark (and the framework) lazily per class.
``common/`` holds what the frameworks share, ``torch/``, ``keras/`` and ``lightning/`` what differs; the flat
layout's module names (``spark_hvd.estimators.rank_run`` ...) still import, as aliases (``_moved.py``), so
pickles and saved Pipelines that name them load.
"""

from __future__ import annotations

from spark_hvd.estimators import _moved
from spark_hvd.estimators.common.lazy import lazy_getattr

_moved.install()

#: public name -> the framework sub-package that serves it
_PUBLIC = {"TorchEstimator": "torch", "TorchModel": "torch", "KerasEstimator": "keras", "KerasModel": "keras",
           "LightningEstimator": "lightning", "LightningModel": "lightning"}

__all__ = list(_PUBLIC)

__getattr__ = lazy_getattr(__name__, _PUBLIC)
