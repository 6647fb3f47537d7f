"""Lightning's estimator: ``LightningEstimator`` and the ``LightningModel`` it fits (``estimator.py``, over the
torch estimator), its params and spec, the rank's ``lightning.Trainer`` run (``rank.py``), its step checkpoints
(``steps.py``), the cluster environment it hands Lightning (``env.py``), the checks of the Trainer's settings
(``checks.py``) and the driver's forward check (``preflight.py``).

The names below are imported on first use. ``spark_hvd.estimators.lightning.LightningModel`` is the class path saved
Pipelines record: it must keep resolving.
"""

from __future__ import annotations

from spark_hvd.estimators.common.lazy import lazy_getattr

#: public name -> the submodule that defines it
_PUBLIC = {"LightningEstimator": "estimator", "LightningModel": "estimator"}

__all__ = sorted(_PUBLIC)

__getattr__ = lazy_getattr(__name__, _PUBLIC)
