"""``KerasSpec``: what every rank of a ``KerasEstimator`` fit receives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spark_hvd.estimators.common.spec import TrainSpec

__all__ = ["KerasSpec"]


@dataclass(frozen=True, kw_only=True)
class KerasSpec(TrainSpec):
    """``TrainSpec`` plus Keras's compile arguments (the optimizer as ``keras.optimizer_spec`` describes it)."""

    optimizer: dict
    loss: Any
    loss_weights: tuple[float, ...] | None = None
    metrics: tuple = ()
    backend: str | None = None  # Keras's backend on the ranks (None: as the rank's process has it)
