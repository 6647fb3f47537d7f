"""What differs between the Keras 3 releases the binding runs on (3.2.1, Databricks 15.4 LTS ML, to 3.15), in
one place.

The optimizer's pass counter moved twice; everything that touches it asks here, each name saying which Keras
versions take which branch, so a branch can be deleted when the floor moves:

- Keras 3.2-3.4: ``optimizer.iterations`` is an instance attribute (a variable set in ``__init__``) that counts
  backward passes; ``apply`` clips every pass's gradients before accumulating them; ``_backend_apply_gradients``
  advances the counter at its end.
- Keras 3.5-3.9: the counter is ``optimizer._iterations``; ``iterations`` became a read-only property (updates:
  ``_iterations // gradient_accumulation_steps``); clipping moved after accumulation, into
  ``_backend_apply_gradients``, which still advances the counter.
- Keras >= 3.10: as 3.5, but ``apply`` advances the counter, after ``_backend_apply_gradients``.
- ``LossScaleOptimizer`` has an ``iterations`` property of its own (the inner optimizer's) in the releases that
  have one (3.6 on); before, it inherits the base's.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import keras


def _version(text: str) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", text)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


#: The installed Keras's ``(major, minor)``.
KERAS_VERSION = _version(keras.version())

#: Keras >= 3.5: the pass counter is ``_iterations`` and ``iterations`` a read-only property; Keras 3.2-3.4:
#: ``iterations`` is the counter itself, an instance attribute (a class property would break ``__init__``).
ITERATIONS_IS_PROPERTY = isinstance(inspect.getattr_static(keras.optimizers.Optimizer, "iterations", None), property)

#: Keras >= 3.10: ``apply`` advances the pass counter after ``_backend_apply_gradients``; Keras 3.2-3.9:
#: ``_backend_apply_gradients`` does it at its end, so an override that skips the base's must advance it itself.
APPLY_ADVANCES_COUNTER = KERAS_VERSION >= (3, 10)


def pass_counter(optimizer: Any) -> Any:
    """The variable that counts the backward passes handed to ``optimizer.apply`` (with gradient accumulation,
    ``gradient_accumulation_steps`` passes make one update): ``_iterations`` on Keras >= 3.5, ``iterations`` on
    Keras 3.2-3.4 (module docstring)."""
    return optimizer._iterations if ITERATIONS_IS_PROPERTY else optimizer.iterations


def _passes(self: Any) -> Any:
    """Backward passes applied (Horovod's): with ``backward_passes_per_step=k`` it grows by one per pass, not
    per update (Keras's own ``iterations`` would be ``passes // k``; the learning rate schedule sees passes
    either way)."""
    return self._iterations


def iterations_members(base: type) -> dict[str, Any]:
    """Class members the distributed subclass of optimizer class ``base`` gets so that ``iterations`` counts
    backward passes, as Horovod's does:

    - Keras >= 3.5, a plain optimizer: a property returning ``_iterations`` (the base's property counts updates);
    - a ``LossScaleOptimizer`` (no accumulation: passes are updates): none, its own ``iterations`` stays;
    - Keras 3.2-3.4: none: the base's ``iterations`` instance attribute counts passes already.
    """
    if not ITERATIONS_IS_PROPERTY or issubclass(base, keras.optimizers.LossScaleOptimizer):
        return {}
    return {"iterations": property(_passes)}


def advance_skipped_pass(optimizer: Any) -> None:
    """Count a pass whose update an override of ``_backend_apply_gradients`` skipped without calling the base's:
    Keras 3.2-3.9 advance the counter inside the base's ``_backend_apply_gradients`` (so this does it); Keras
    >= 3.10 in ``apply``, after it (so this does nothing)."""
    if not APPLY_ADVANCES_COUNTER:
        pass_counter(optimizer).assign_add(1)


def compute_loss(model: Any, x: Any, y: Any, y_pred: Any) -> Any:
    """``model.compute_loss(x=x, y=y, y_pred=y_pred)`` as ``model.fit``'s train step calls it, in inference mode:
    ``training=False`` where ``compute_loss`` takes it (Keras >= 3.4; Keras 3.2-3.3 have no such argument, and
    computes the loss the same way without it)."""
    kwargs: dict[str, Any] = {"x": x, "y": y, "y_pred": y_pred}
    if "training" in inspect.signature(model.compute_loss).parameters:
        kwargs["training"] = False
    return model.compute_loss(**kwargs)


#: Keras >= 3.7: ``fit``'s epoch iterator starts the data over once an epoch of ``steps_per_epoch`` batches has
#: used the whole dataset, and restarts a ``PyDataset`` (``on_epoch_end``) after peeking at its first batches for
#: their shapes. Keras 3.2-3.6 do neither: an exhausted iterator stays so (the next epoch finds no batch, "Your
#: input ran out of data", and ``fit`` fails on the empty validation logs), and training starts after the peeked
#: batches.
EPOCH_ITERATOR_RESETS = KERAS_VERSION >= (3, 7)


def fit_steps(steps: int | None, dataset: Any) -> int | None:
    """The ``steps_per_epoch`` / ``validation_steps`` to hand ``model.fit`` for ``steps`` batches of ``dataset``
    (a ``keras.utils.PyDataset``) per epoch: ``steps`` itself, except on Keras 3.2-3.6 when it is the whole
    dataset: then None, so that every epoch iterates the dataset afresh (``EPOCH_ITERATOR_RESETS``)."""
    if steps is not None and not EPOCH_ITERATOR_RESETS and steps == len(dataset):
        return None
    return steps


class _RestartAfterPeek(keras.callbacks.Callback):
    """Restarts the training dataset before the first epoch and the validation one before each evaluation."""

    def __init__(self, train: Any, val: Any) -> None:
        super().__init__()
        self._train, self._val = train, val

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._train.on_epoch_end()

    def on_test_begin(self, logs: dict | None = None) -> None:
        if self._val is not None:
            self._val.on_epoch_end()


def restart_after_peek(train: Any, val: Any = None) -> list[Any]:
    """Callbacks for ``model.fit`` on ``train`` (and ``validation_data=val``), ``PyDataset`` streams whose
    ``on_epoch_end`` restarts a partly read epoch (``spark_hvd.data.keras_loader.KerasBatchDataset``).

    Keras 3.2-3.6 read the first batches of each to learn their shapes and start training (or the evaluation)
    without restarting them, so every epoch would start a few batches late: a callback restarts them before the
    first training batch (``on_train_begin``) and before each evaluation (``on_test_begin``). Keras >= 3.7 restart
    them itself (``EPOCH_ITERATOR_RESETS``): no callback.
    """
    return [] if EPOCH_ITERATOR_RESETS else [_RestartAfterPeek(train, val)]


def checkpoint_mode(callback: Any) -> tuple[str, float]:
    """``(mode, min_delta)`` of a ``keras.callbacks.ModelCheckpoint``: ``mode`` "min", "max" or "auto".

    Keras releases whose ``ModelCheckpoint`` derives from ``MonitorCallback`` (3.15 does; 3.10 does not) keep
    ``mode`` and ``min_delta``. Older ones (3.3 to at least 3.10) keep neither: the mode is read from the
    comparison they chose (``monitor_op``: ``np.greater`` for "max", ``np.less`` for "min"), and they have no
    ``min_delta`` (0).
    """
    if hasattr(callback, "mode"):
        return str(callback.mode), float(getattr(callback, "min_delta", 0.0) or 0.0)
    op = getattr(callback, "monitor_op", None)
    name = getattr(op, "__name__", "")
    return {"greater": "max", "less": "min"}.get(name, "auto"), 0.0


def assign(variable: Any, value: Any) -> Any:
    """``variable.assign(value)``, returning the assigned value (for ``tf.control_dependencies`` and the like):
    Keras >= 3.5 returns it; Keras 3.2-3.4 return None, so the variable is read back after the assignment (in a
    ``tf.function`` the read is ordered after the write to the same variable)."""
    out = variable.assign(value)
    return variable.value if out is None else out
