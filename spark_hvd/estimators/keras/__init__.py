"""Keras 3's estimator: ``KerasEstimator`` and the ``KerasModel`` it fits (``estimator.py``), its params and spec,
the rank's training loop (``rank.py``), the model as ``.keras`` bytes (``serde.py``), the backend a rank or an
executor runs (``backend.py``), batched prediction (``inference.py``) and the driver's forward check
(``preflight.py``). What every framework shares is in ``spark_hvd.estimators.common``.

The names below are imported on first use, so importing a submodule loads no pyspark.ml.
``spark_hvd.estimators.keras.KerasModel`` is the class path saved Pipelines record: it must keep resolving.
"""

from __future__ import annotations

from spark_hvd.estimators.common.lazy import lazy_getattr

#: public name -> the submodule that defines it
_PUBLIC = {"KerasEstimator": "estimator", "KerasModel": "estimator", "serialize_keras_model": "serde",
           "deserialize_keras_model": "serde"}

__all__ = sorted(_PUBLIC)

__getattr__ = lazy_getattr(__name__, _PUBLIC)
