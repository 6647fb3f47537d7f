"""``TorchSpec``: what every rank of a ``TorchEstimator`` fit receives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spark_hvd.estimators.common.spec import CompiledSpec

__all__ = ["TorchSpec"]


@dataclass(frozen=True, kw_only=True)
class TorchSpec(CompiledSpec):
    """``CompiledSpec`` (the optimizer as ``torch.optimizer_spec`` describes it) plus the torch loop's settings."""

    input_shapes: tuple | None = None
    train_minibatch_fn: Any = None
    lr_scheduler: Any = None
    lr_scheduler_interval: str = "epoch"
    mixed_precision: str | None = None  #: "bf16", "fp16" or None (see ``precision.py``)
