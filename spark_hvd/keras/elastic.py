"""Horovod's Keras elastic API for Keras 3: ``hvd.elastic.run``, ``KerasState`` and the state callbacks.

``KerasState(model, optimizer, **objects)`` snapshots the model's and the optimizer's variables (numpy copies) on
``commit()``, assigns them back on ``restore()`` and broadcasts them from rank 0 on ``sync()`` (which snapshots the
synced values, as Horovod's); other keywords are plain objects (``ObjectState``). Under
``spark_hvd.runner.run_elastic`` a relaunched job starts from the last commit (see ``spark_hvd.core.elastic``).
"""

from __future__ import annotations

from typing import Any

import keras

from spark_hvd import _binding_common as common
from spark_hvd._keras_common.state import KerasState
from spark_hvd.core.elastic import ElasticSampler, HostsUpdatedInterrupt, ObjectState, State, run_fn


class CommitStateCallback(keras.callbacks.Callback):
    """``state.commit()`` every ``batches_per_commit`` batches and at the end of every epoch (Horovod's)."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be >= 1, got {batches_per_commit}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self._since = 0

    def on_train_begin(self, logs: Any = None) -> None:
        self._since = 0  # the same count on every rank after a (re)start

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._since += 1
        if self._since >= self.batches_per_commit:
            self._since = 0
            self.state.commit()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps ``state.batch`` at the last finished batch (0 after an epoch), and shortens the first epoch after a
    reset by the batches already done when ``fit`` was given ``steps_per_epoch`` (Horovod's)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self._steps: int | None = None

    def on_train_begin(self, logs: Any = None) -> None:
        self._steps = None

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        steps = (self.params or {}).get("steps")
        if steps:
            self._steps = steps if self._steps is None else self._steps
            self.params["steps"] = self._steps - self.state.batch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps ``state.epoch`` at the number of epochs finished across resets (Keras counts from 0 in each ``fit``)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self._first = state.epoch

    def on_train_begin(self, logs: Any = None) -> None:
        self._first = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.epoch = self._first + epoch + 1


def _reset() -> None:
    common.shutdown()
    common.core().init()


def run(func: Any) -> Any:
    """Horovod's ``hvd.elastic.run`` decorator for Keras: ``func(state, *args, **kwargs)`` runs from a synced state,
    and under ``spark_hvd.runner.run_elastic`` resumes from the last commit after a lost rank or a resize."""
    return run_fn(func, _reset)


__all__ = ["CommitStateCallback", "ElasticSampler", "HostsUpdatedInterrupt", "KerasState", "ObjectState", "State",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]
