"""The driver's forward check of a Keras model (see ``spark_hvd.estimators.common.preflight``): each feature
column's row shape against the model's input it feeds (naming both), then the model called on a few prepared rows
as ``model.fit`` gets them, each output checked against its label and loss.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from spark_hvd.estimators.common.errors import param_error
from spark_hvd.estimators.common.preflight import check_output

__all__ = ["keras_forward_check"]


def keras_forward_check(name: str, spec: Any, label_max: dict[str, float], rows: int = 4) -> None:
    """Check the Keras model of ``spec`` (a ``KerasSpec``) on ``rows`` prepared training rows on the driver, as
    ``model.fit`` on a rank gets them; raise ``ValueError`` naming the column and both shapes or numbers.

    First each feature column's row shape against the model input it feeds (``model.inputs``, where the model has
    them); then, only where the driver runs Keras on the ranks' ``backend``, one call of the model, each output
    against its label and loss (``label_max`` as for :func:`torch_forward_check`), and the loss on those rows as
    ``model.fit`` computes it (``compute_loss``).
    """
    import keras

    from spark_hvd._keras_common import compat as keras_compat
    from spark_hvd.data.keras_loader import KerasBatchDataset
    from spark_hvd.estimators.common.rank_data import ShardReaders
    from spark_hvd.estimators.keras.serde import deserialize_keras_model

    small = dataclasses.replace(spec, batch_size=rows, shuffle=False, train_steps_per_epoch=1)
    batches = KerasBatchDataset(ShardReaders(small, 0, 1).readers["train"], spec.feature_cols, spec.label_cols)
    try:
        x, y = batches[0][:2]
    finally:
        batches.on_epoch_end()
    xs, ys = (list(v) if isinstance(v, tuple) else [v] for v in (x, y))
    ranks_backend = getattr(spec, "backend", None)
    if ranks_backend and ranks_backend != keras.backend.backend():
        # the ranks run another Keras backend than this driver: a custom layer may work only there, so the shapes
        # are checked from the model's inputs and nothing is run
        try:
            model = deserialize_keras_model(spec.model_bytes, compile=False)
        except Exception:  # noqa: BLE001 - it loads on the ranks' backend; nothing to check here
            return
        _check_keras_inputs(name, model, list(spec.feature_cols), xs)
        return
    model = deserialize_keras_model(spec.model_bytes, compile=False)
    _check_keras_inputs(name, model, list(spec.feature_cols), xs)
    shapes = ", ".join(f"{c} {tuple(a.shape)}" for c, a in zip(spec.feature_cols, xs, strict=True))
    where = f"on a forward pass of {len(xs[0])} prepared rows on the driver"
    try:
        out = model(x, training=False)
    except Exception as exc:
        raise param_error(name, f"the model failed {where} (inputs: {shapes}): {type(exc).__name__}: {exc}. "
                         "Check the feature columns' shapes against the model's inputs") from exc
    outputs = list(out.values()) if isinstance(out, dict) else list(out) if isinstance(out, list | tuple) else [out]
    if len(outputs) != len(spec.label_cols):
        raise param_error(name, f"the model returns {len(outputs)} outputs for {len(spec.label_cols)} label columns "
                         f"{list(spec.label_cols)}; give one label column per output")
    losses = list(spec.loss) if isinstance(spec.loss, list | tuple) else [spec.loss] * len(outputs)
    for col, o, label, item in zip(spec.label_cols, outputs, ys, losses, strict=True):
        fn = _keras_loss_function(item)
        check_output(name, col, tuple(o.shape), tuple(label.shape),
                      fn is keras.losses.sparse_categorical_crossentropy, fn in _keras_elementwise(),
                      label_max.get(col), "loss='sparse_categorical_crossentropy'")
    model.compile(loss=spec.loss, loss_weights=list(spec.loss_weights) if spec.loss_weights else None)
    try:  # what model.fit's train step calls
        keras_compat.compute_loss(model, x, y, out)
    except Exception as exc:
        got = ", ".join(f"output {tuple(o.shape)} vs label {c!r} {tuple(a.shape)}"
                        for c, o, a in zip(spec.label_cols, outputs, ys, strict=True))
        raise param_error(name, f"the loss failed {where} ({got}): {type(exc).__name__}: {exc}") from exc


def _check_keras_inputs(name: str, model: Any, cols: list[str], arrays: list[Any]) -> None:
    """Each feature column's row shape against the Keras input it feeds, after the rank adjustment a Keras
    functional model makes itself (a trailing 1 added or dropped), skipped where the model has no ``inputs`` (a
    subclassed model shows its mistakes in the forward pass)."""
    try:
        inputs = list(model.inputs or [])
    except (AttributeError, ValueError):
        return
    if not inputs:
        return
    if len(inputs) != len(cols):
        raise param_error(name, f"the model takes {len(inputs)} inputs for {len(cols)} feature columns {cols}; give "
                         "one feature column per model input, in the model's input order")
    for i, (col, arr, inp) in enumerate(zip(cols, arrays, inputs, strict=True)):
        want = tuple(inp.shape[1:])
        got = fed = tuple(arr.shape[1:])
        if len(fed) == len(want) + 1 and fed[-1] == 1:  # Keras drops a trailing 1 ...
            fed = fed[:-1]
        elif len(fed) == len(want) - 1 and want[-1] == 1:  # ... and adds one where the input ends in 1
            fed = (*fed, 1)
        if len(want) == len(fed) and all(w is None or w == g for w, g in zip(want, fed, strict=True)):
            continue
        label = f"input {i} ({getattr(inp, 'name', '?')!r})" if len(cols) > 1 else "input"
        fix = ("give a column of that shape (an array column, or a Vector of that many values)")
        if None not in want and math.prod(want) == math.prod(got):
            fix = f"add keras.layers.Reshape({want}) after the model's Input({got}), or {fix}"
        raise param_error(name, f"feature column {col!r} has rows of shape {got} but the model's {label} expects "
                         f"rows of shape {want}; {fix}")


def _keras_loss_function(item: Any) -> Any:
    """The function behind a Keras loss given by name, as a built-in ``Loss`` object, or as a function."""
    import keras

    if isinstance(item, str):
        try:
            item = keras.losses.get(item)
        except ValueError:
            return None
    return getattr(item, "fn", item)


def _keras_elementwise() -> tuple:
    """Keras's loss functions that compare output and label value by value."""
    import keras

    ls = keras.losses
    return (ls.mean_squared_error, ls.mean_absolute_error, ls.mean_absolute_percentage_error,
            ls.mean_squared_logarithmic_error, ls.huber, ls.log_cosh, ls.binary_crossentropy,
            ls.binary_focal_crossentropy, ls.categorical_crossentropy, ls.categorical_focal_crossentropy)
