"""Horovod's Keras elastic API for Keras 3: ``hvd.elastic.run`` and ``KerasState``.

``KerasState(model, optimizer, **objects)`` snapshots the model's and the optimizer's variables (numpy copies) on
``commit()``, assigns them back on ``restore()`` and broadcasts them from rank 0 on ``sync()``; other keywords are
plain objects (``ObjectState``). Under ``spark_hvd.runner.run_elastic`` a relaunched job starts from the last
commit (see ``spark_hvd.core.elastic``).
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
        super().sync()

    def snapshot(self) -> Any:
        return {**super().snapshot(), "variables": self._saved_vars}

    def load_snapshot(self, value: Any) -> None:
        super().load_snapshot(value)
        self._saved_vars = list(value["variables"])


def _reset() -> None:
    common.shutdown()
    common.core().init()


def run(func: Any) -> Any:
    """Horovod's ``hvd.elastic.run`` decorator for Keras: ``func(state, *args, **kwargs)`` runs from a synced state,
    and under ``spark_hvd.runner.run_elastic`` resumes from the last commit after a lost rank or a resize."""
    return run_fn(func, _reset)


__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "KerasState", "ObjectState", "State", "run"]
