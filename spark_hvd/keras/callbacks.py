"""Keras 3 callbacks of the Horovod API: broadcast of initial variables, metric averaging, LR warmup and schedule,
best-model checkpoint."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from spark_hvd import _binding_common as common
from spark_hvd.keras.functions import broadcast_variables

log = logging.getLogger(__name__)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, give every rank root's model weights (and optimizer state when built).

    Training from a random initialisation or a checkpoint loaded on root only then starts identically
    everywhere.
    """

    def __init__(self, root_rank: int = 0, device: str = "", local_variables: Sequence[Any] | None = None) -> None:
        """``local_variables``: variables each rank keeps its own (Horovod's), left out of the broadcast.
        ``device`` is accepted for Horovod compatibility and has no effect."""
        super().__init__()
        self.root_rank = root_rank
        self.local_variables = list(local_variables or [])
        self.broadcast_done = False

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.broadcast_done:
            return
        common.require_init("BroadcastGlobalVariablesCallback")
        variables = list(self.model.variables)
        opt = getattr(self.model, "optimizer", None)
        if opt is not None and getattr(opt, "built", False):
            variables += list(opt.variables)
        local = {id(v) for v in self.local_variables}
        variables = [v for v in variables if id(v) not in local]
        broadcast_variables(variables, root_rank=self.root_rank, prefix="bcast.keras.var")
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of each epoch, replace every numeric entry of ``logs`` by its average over the ranks.

    Put it before callbacks that read the logs (checkpointing, early stopping, LR schedules) so all ranks
    decide alike.
    """

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not logs:
            return
        common.require_init("MetricAverageCallback")
        keys = sorted(k for k, v in logs.items() if isinstance(v, (int, float, np.number, np.ndarray))
                      or hasattr(v, "numpy"))
        if not keys:
            return
        values = np.array([float(np.asarray(logs[k])) for k in keys], dtype=np.float64)
        common.core().allreduce(values, name=f"metric_average.{epoch}", op=common.Average)
        for k, v in zip(keys, values.tolist(), strict=True):
            logs[k] = v


def _assign_lr(model: keras.Model, lr: float, who: str) -> None:
    var = getattr(model.optimizer, "learning_rate", None)
    if not hasattr(var, "assign"):
        raise ValueError(f"{who} needs an optimizer with a float learning rate, not a LearningRateSchedule")
    var.assign(lr)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier`` from ``start_epoch`` up to ``end_epoch`` (Horovod's).

    Args:
        initial_lr: the base learning rate (usually ``base_lr * hvd.size()``).
        multiplier: a constant, or a function of the epoch (an int with ``staircase``, else a fraction updated
            every batch) returning the factor.
        start_epoch, end_epoch: the epochs ``[start_epoch, end_epoch)`` it acts on (``end_epoch=None``: to the end).
        staircase: change the rate once per epoch (True) or every batch with a fractional epoch (False).
        momentum_correction: accepted for Horovod compatibility; no effect (see ``LearningRateWarmupCallback``).
        steps_per_epoch: batches per epoch (default: what ``model.fit`` reports); needed when not ``staircase``.
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float], start_epoch: int = 0,
                 end_epoch: int | None = None, staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None) -> None:
        super().__init__()
        if end_epoch is not None and end_epoch < start_epoch:
            raise ValueError(f"end_epoch ({end_epoch}) must be >= start_epoch ({start_epoch})")
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda _epoch, m=float(multiplier): m)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0

    def _active(self, epoch: int) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
        if not self.staircase and not self.steps_per_epoch:
            raise ValueError("LearningRateScheduleCallback(staircase=False) needs steps_per_epoch (model.fit did not "
                             "report it)")

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.current_epoch = epoch
        if self.staircase and self._active(epoch):
            _assign_lr(self.model, self.initial_lr * self.multiplier(epoch), "LearningRateScheduleCallback")

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if not self.staircase and self._active(self.current_epoch):
            epoch = self.current_epoch + float(batch) / self.steps_per_epoch
            _assign_lr(self.model, self.initial_lr * self.multiplier(epoch), "LearningRateScheduleCallback")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Horovod's ``BestModelCheckpoint``: a ``ModelCheckpoint`` that keeps only improvements of ``monitor``.

    Give it to ``KerasEstimator(checkpoint_callback=...)`` (which decides where checkpoints go), or use it in
    ``model.fit`` with a ``filepath`` of your own (rank 0 only, as any checkpoint).
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, mode: str = "auto", save_freq: Any = "epoch",
                 filepath: str = "best_model.keras") -> None:
        super().__init__(filepath=filepath, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=False, mode=mode, save_freq=save_freq)


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs`` (per batch).

    The usual recipe for large effective batches (Goyal et al.): scale the LR by the number of ranks, warm up.

    Args:
        initial_lr: the learning rate at the end of the warmup (usually ``base_lr * hvd.size()``).
        warmup_epochs: number of epochs of the ramp.
        momentum_correction: accepted for Horovod compatibility; Keras 3 compiles momentum as a constant of the
            train step, so it cannot be corrected per batch and this has no effect.
        steps_per_epoch: batches per epoch (default: what ``model.fit`` reports).
        verbose: log the learning rate at the end of the warmup.
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        super().__init__()
        if warmup_epochs < 0:
            raise ValueError(f"warmup_epochs must be >= 0, got {warmup_epochs}")
        self.initial_lr = float(initial_lr)
        self.warmup_epochs = warmup_epochs
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = 0

    def _set_lr(self, lr: float) -> None:
        _assign_lr(self.model, lr, "LearningRateWarmupCallback")

    def multiplier(self, epoch: float) -> float:
        """LR multiplier at fractional ``epoch`` (Horovod's formula, reaching 1 at ``warmup_epochs``)."""
        n = common.size()
        epoch += 1.0 / self.steps_per_epoch if self.steps_per_epoch else 0.0
        return 1.0 / n * (epoch * (n - 1) / self.warmup_epochs + 1)

    def on_train_begin(self, logs: dict | None = None) -> None:
        common.require_init("LearningRateWarmupCallback")
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
        if not self.steps_per_epoch:
            raise ValueError("LearningRateWarmupCallback needs steps_per_epoch (model.fit did not report it)")

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.current_epoch >= self.warmup_epochs or self.warmup_epochs == 0:
            return
        epoch = self.current_epoch + float(batch) / self.steps_per_epoch
        self._set_lr(self.initial_lr * min(1.0, self.multiplier(epoch)))

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if epoch == self.warmup_epochs - 1:
            self._set_lr(self.initial_lr)
            if self.verbose:
                log.info("epoch %d: finished learning rate warmup to %g", epoch + 1, self.initial_lr)
