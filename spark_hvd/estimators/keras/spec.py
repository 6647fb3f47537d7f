"""``KerasSpec``: what every rank of a ``KerasEstimator`` fit receives."""

from __future__ import annotations

from dataclasses import dataclass

from spark_hvd.estimators.common.spec import CompiledSpec

__all__ = ["KerasSpec"]


@dataclass(frozen=True, kw_only=True)
class KerasSpec(CompiledSpec):
    """``CompiledSpec`` (the optimizer as ``keras.optimizer_spec`` describes it) plus the Keras backend."""

    backend: str | None = None  # Keras's backend on the ranks (None: as the rank's process has it)
