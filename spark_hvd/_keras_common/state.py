"""Keras variables across ranks, shared by ``spark_hvd.keras`` and ``spark_hvd.tensorflow``: ``broadcast_variables``
(of Keras or TensorFlow variables) and the elastic ``KerasState``. Keras is imported when they run, not with this
module, so ``import spark_hvd.tensorflow`` does not run Keras's backend selection."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from spark_hvd import _binding_common as common
from spark_hvd.core.elastic import ObjectState

if TYPE_CHECKING:
    import keras


def broadcast_variables(variables: Sequence[Any], root_rank: int = 0, prefix: str = "bcast.var") -> None:
    """Assign root's values to ``variables`` (Keras variables, or tf.Variables) on every rank; eager only."""
    import keras

    common.require_init("broadcast_variables()")
    c = common.core()
    bufs, handles = [], []
    for i, v in enumerate(variables):
        value = v.numpy() if hasattr(v, "numpy") and not isinstance(v, keras.Variable) else \
            keras.ops.convert_to_numpy(v)
        buf = np.array(value, copy=True, order="C")
        view, _ = common.to_core_buffer(buf)
        bufs.append(buf)
        handles.append(c.broadcast_async(view, root_rank, name=f"{prefix}.{i}"))
    for v, buf, h in zip(variables, bufs, handles, strict=True):
        c.synchronize(h)
        v.assign(buf)


class VariablesState(ObjectState):
    """Elastic state of a list of variables (Keras or TensorFlow), plus plain objects: numpy copies of their values
    are the snapshot, taken on ``commit()`` (``save``) and by ``sync()``, assigned back on ``restore()``.

    A subclass lists the variables (``_variables``), copies their values (``_values``) and broadcasts them
    (``_broadcast``); it sets what ``_values`` reads before calling ``__init__``.
    """

    def __init__(self, **objects: Any) -> None:
        self._saved_vars = self._values()
        super().__init__(**objects)

    def _variables(self) -> list[Any]:
        raise NotImplementedError

    def _values(self) -> list[np.ndarray]:
        raise NotImplementedError

    def _broadcast(self, variables: list[Any]) -> None:
        raise NotImplementedError

    def save(self) -> None:
        self._saved_vars = self._values()
        super().save()

    def restore(self) -> None:
        variables = self._variables()
        if len(variables) != len(self._saved_vars):
            raise ValueError(f"{type(self).__name__}.restore: the snapshot has {len(self._saved_vars)} variables, "
                             f"the state now has {len(variables)} (was a layer or an optimizer slot added since?)")
        for var, value in zip(variables, self._saved_vars, strict=True):
            var.assign(value)
        super().restore()

    def sync(self) -> None:
        self.sync_from_driver()
        variables = self._variables()
        if common.core().size() > 1 and variables:
            self._broadcast(variables)
        self._saved_vars = self._values()  # Horovod's: the synced values are the snapshot restore() goes back to
        super().sync()

    def snapshot(self) -> Any:
        return {**super().snapshot(), "variables": self._saved_vars}

    def load_snapshot(self, value: Any) -> None:
        super().load_snapshot(value)
        self._saved_vars = list(value["variables"])


class KerasState(VariablesState):
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
        super().__init__(**objects)

    def _variables(self) -> list[Any]:
        return list(self.model.variables) + (list(self.optimizer.variables) if self.optimizer is not None else [])

    def _values(self) -> list[np.ndarray]:
        import keras

        return [np.array(keras.ops.convert_to_numpy(v), copy=True) for v in self._variables()]

    def _broadcast(self, variables: list[Any]) -> None:
        broadcast_variables(variables, root_rank=0, prefix="elastic.keras")
