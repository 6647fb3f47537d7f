"""Horovod's Keras elastic API for Keras 3: ``hvd.elastic.run``, ``KerasState`` and the state callbacks.

``KerasState(model, optimizer, **objects)`` snapshots the model's and the optimizer's variables (numpy copies) on
``commit()``, assigns them back on ``restore()`` and broadcasts them from rank 0 on ``sync()`` (which snapshots the
synced values, as Horovod's); other keywords are plain objects (``ObjectState``). Under
``spark_hvd.runner.run_elastic`` a relaunched job starts from the last commit (see ``spark_hvd.core.elastic``).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from spark_hvd import _binding_common as common
from spark_hvd.core.elastic import ElasticSampler, HostsUpdatedInterrupt, ObjectState, State, run_fn
from spark_hvd.keras.functions import broadcast_variables


class KerasState(ObjectState):
    """Elastic state of a Keras training process (Horovod's ``hvd.elastic.KerasState``).

    Args:
        model: the Keras model; its variables (trainable and not) are the state.
        optimizer: its optimizer (default ``model.optimizer``); built on the model's trainable variables when it
            has not been yet, so that its slots are part of every snapshot.
        objects: plain objects (``epoch=0, batch=0``), exposed as attributes.
    """

    def __init__(self, model: keras.Model, optimizer: Any = None, **objects: Any) -> None:
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if self.optimizer is not None and not self.optimizer.built and model.built:
            self.optimizer.build(model.trainable_variables)
        self._saved_vars = self._values()
        super().__init__(**objects)

    def _variables(self) -> list[Any]:
        return list(self.model.variables) + (list(self.optimizer.variables) if self.optimizer is not None else [])

    def _values(self) -> list[np.ndarray]:
        return [np.array(keras.ops.convert_to_numpy(v), copy=True) for v in self._variables()]

    def save(self) -> None:
        self._saved_vars = self._values()
        super().save()

    def restore(self) -> None:
        variables = self._variables()
        if len(variables) != len(self._saved_vars):
            raise ValueError(f"KerasState.restore: the snapshot has {len(self._saved_vars)} variables, the model and "
                             f"optimizer now have {len(variables)} (was a layer or an optimizer slot added since?)")
        for var, value in zip(variables, self._saved_vars, strict=True):
            var.assign(value)
        super().restore()

    def sync(self) -> None:
        self.sync_from_driver()
        if common.core().size() > 1:
            broadcast_variables(self._variables(), root_rank=0, prefix="elastic.keras")
        self._saved_vars = self._values()  # Horovod's: the synced values are the snapshot restore() goes back to
        super().sync()

    def snapshot(self) -> Any:
        return {**super().snapshot(), "variables": self._saved_vars}

    def load_snapshot(self, value: Any) -> None:
        super().load_snapshot(value)
        self._saved_vars = list(value["variables"])


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
