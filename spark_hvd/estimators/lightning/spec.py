"""``LightningSpec``: what every rank of a ``LightningEstimator`` fit receives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spark_hvd.estimators.common.spec import TrainSpec

__all__ = ["LightningSpec"]


@dataclass(frozen=True, kw_only=True)
class LightningSpec(TrainSpec):
    """``TrainSpec`` plus the input shapes and what the rank's ``lightning.Trainer`` is given (the module brings its
    own optimizer, loss and metrics; ``callbacks`` are Lightning callbacks)."""

    input_shapes: tuple | None = None
    trainer_args: dict | None = None  #: extra ``lightning.Trainer`` arguments (override the estimator's)
    logger: Any = None  #: a Lightning logger (or a list of them); None: none
    log_every_n_steps: int = 50
    precision: Any = None  #: Lightning's ``precision`` ("bf16-mixed", "16-mixed", 32 ...); None: its default
    gradient_clip_val: float | None = None
    profiler: Any = None  #: a Lightning profiler's name ("simple", "advanced", "pytorch") or object; None: none
