"""Horovod's TensorFlow elastic API: ``hvd.elastic.run``, ``TensorFlowKerasState``, ``TensorFlowState``.

``TensorFlowKerasState(model, optimizer, **objects)`` is the ``KerasState`` of ``spark_hvd.keras`` (the model's and the
optimizer's variables); ``TensorFlowState(variables, **objects)`` keeps a list of ``tf.Variable``. Both snapshot
numpy copies on ``commit()``, assign them back on ``restore()``, and broadcast from rank 0 on ``sync()`` (the
synced values become the snapshot). Under ``spark_hvd.runner.run_elastic`` a relaunched job starts from the last
commit (see ``spark_hvd.core.elastic``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from spark_hvd import _binding_common as common
from spark_hvd._keras_common.state import KerasState, VariablesState
from spark_hvd.core.elastic import ElasticSampler, HostsUpdatedInterrupt, ObjectState, State, run_fn
from spark_hvd.tensorflow.functions import broadcast_variables


class TensorFlowKerasState(KerasState):
    """Elastic state of a Keras model trained from TensorFlow (Horovod's). ``backend`` is accepted for Horovod
    compatibility (TF1 sessions do not apply)."""

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **objects: Any) -> None:
        del backend
        super().__init__(model, optimizer, **objects)


class TensorFlowState(VariablesState):
    """Elastic state of a list of ``tf.Variable`` (Horovod's; eager only, ``session`` must be None).

    Args:
        variables: the variables (default: none).
        objects: plain objects (``epoch=0, batch=0``), exposed as attributes.
    """

    def __init__(self, variables: Sequence[Any] | None = None, session: Any = None, **objects: Any) -> None:
        if session is not None:
            raise NotImplementedError("TensorFlowState(session=...): TF1 sessions are not supported; run eagerly")
        self.variables = list(variables or [])
        super().__init__(**objects)

    def _variables(self) -> list[Any]:
        return self.variables

    def _values(self) -> list[np.ndarray]:
        return [np.array(tf.convert_to_tensor(v).numpy(), copy=True) for v in self.variables]

    def _broadcast(self, variables: list[Any]) -> None:
        broadcast_variables(variables, root_rank=0)


def _reset() -> None:
    common.shutdown()
    common.core().init()


def run(func: Any) -> Any:
    """Horovod's ``hvd.elastic.run`` decorator: ``func(state, *args, **kwargs)`` runs from a synced state, and under
    ``spark_hvd.runner.run_elastic`` resumes from the last commit after a lost rank or a resize."""
    return run_fn(func, _reset)


__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State", "TensorFlowKerasState",
           "TensorFlowState", "run"]
