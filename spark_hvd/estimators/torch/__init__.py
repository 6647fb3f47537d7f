"""PyTorch's estimator: ``TorchEstimator`` and the ``TorchModel`` it fits (``estimator.py``), its params and spec,
the rank's training loop (``rank.py``), the module and optimizer as bytes (``serde.py``), mixed precision
(``precision.py``) and the driver's forward check (``preflight.py``). What every framework shares is in
``spark_hvd.estimators.common``.

The names below are imported on first use, so importing a submodule (a rank imports ``rank``) loads no pyspark.ml.
``spark_hvd.estimators.torch.TorchModel`` is the class path saved Pipelines record: it must keep resolving.
"""

from __future__ import annotations

from spark_hvd.estimators.common.lazy import lazy_getattr

#: public name -> the submodule that defines it
_PUBLIC = {"TorchEstimator": "estimator", "TorchModel": "estimator", "TorchModuleEstimator": "estimator",
           "EarlyStopping": "estimator"}

__all__ = sorted(_PUBLIC)

__getattr__ = lazy_getattr(__name__, _PUBLIC)
