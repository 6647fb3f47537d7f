"""The Params only the Keras estimator and its model take (the shared ones: ``spark_hvd.estimators.common.params``)."""

from __future__ import annotations

from typing import Any

from spark_hvd.estimators.common.params import (
    ElasticParams,
    EstimatorParams,
    ModelParams,
    StepCheckpointParams,
    _add_accessors,
    _p,
)

__all__ = ["KerasEstimatorParams", "KerasModelParams"]


def _to_keras_backend(value: Any) -> str | None:
    """None or one of Keras's backends that spark_hvd trains on (the error names the param)."""
    if value is None:
        return None
    if value not in ("tensorflow", "torch", "jax"):
        raise ValueError(f"backend must be 'tensorflow', 'torch' or 'jax' (Keras's backend), got {value!r}")
    return str(value)


@_add_accessors
class KerasEstimatorParams(StepCheckpointParams, ElasticParams, EstimatorParams):
    """``EstimatorParams`` plus what only the Keras estimator takes."""

    custom_objects = _p("custom_objects", "dict of custom layers/losses/metrics needed to load the model")
    checkpoint_callback = _p("checkpoint_callback", "a keras ModelCheckpoint deciding which epochs are checkpointed "
                             "(e.g. best only); default: every epoch")
    backend = _p("backend", "Keras's backend on the ranks: 'tensorflow', 'torch' or 'jax'; default None: the "
                 "driver's own Keras backend. A rank whose Python worker already runs Keras on another backend runs "
                 "in a fresh Python process", _to_keras_backend)

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(backend=None)


@_add_accessors
class KerasModelParams(ModelParams):
    """``ModelParams`` plus the Keras custom objects and backend."""

    custom_objects = _p("custom_objects", "dict of custom layers/losses/metrics needed to load the model")
    backend = _p("backend", "Keras's backend transform runs the model on ('tensorflow', 'torch', 'jax'; fit sets "
                 "the estimator's); None: the Python worker's Keras as it is", _to_keras_backend)

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(backend=None)
