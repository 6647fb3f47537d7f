"""``log_mlflow`` and ``load_mlflow``: the methods every fitted stage (``TorchModel``, ``KerasModel``,
``LightningModel``) has for MLflow, as one mixin. Both import ``pyfunc`` (and through it MLflow) only when called,
so a rank that imports a stage's class never loads MLflow."""

from __future__ import annotations

from typing import Any

__all__ = ["MlflowStage"]


class MlflowStage:
    """Mixin of the fitted stages: log the stage as an MLflow pyfunc, and load one back as the stage."""

    def log_mlflow(self, name: str = "model", input_example: Any = None, registered_model_name: str | None = None,
                   **kwargs: Any) -> Any:
        """Log the stage as an MLflow pyfunc that scores raw columns as ``transform`` does (the same code), the
        framework's flavour (``mlflow.pytorch`` / ``mlflow.keras``) beside it; returns the ``ModelInfo``. See
        ``estimators/common/pyfunc.py``."""
        from spark_hvd.estimators.common.pyfunc import log_mlflow

        return log_mlflow(self, name, input_example, registered_model_name, **kwargs)

    @classmethod
    def load_mlflow(cls, model_uri: str) -> Any:
        """The stage that ``log_mlflow`` logged at ``model_uri`` (``runs:/<id>/model``, ``models:/<name>/<version>``,
        a path) as this Spark ML model class again: same uid, params and network; ``transform`` at its own speed
        (where ``spark_udf`` over the pyfunc pays MLflow's per-cell conversions: docs/serving.md). Raises where the
        URI holds no such pyfunc, or a stage of another class."""
        from spark_hvd.estimators.common.pyfunc import load_stage

        return load_stage(model_uri, cls)
