"""Driver-side pre-flight: the mistakes a new user makes, caught before any training task starts.

Two kinds, both raised on the driver with the estimator's name, what was wrong and the fix:

- :func:`check_not_classes` (before any Spark job): a class passed where an instance is wanted
  (``loss=torch.nn.CrossEntropyLoss``, ``optimizer=torch.optim.Adam``, ``model=MyNet``), which otherwise fails
  30 s later on a rank in the framework's words ("Boolean value of Tensor ... is ambiguous").
- :func:`torch_forward_check` (after the data is prepared, before the ranks start): the module called once on a
  few prepared rows, exactly as a rank would feed them, and each output compared with its label: a class-index
  loss needs one logit per class (the label column's largest index + 1), a regression loss as many values as the
  label; the error names both numbers. A module or loss that fails on those rows fails here, with the shapes.
- :func:`keras_forward_check` (the same moment, for a Keras model): each feature column's row shape against the
  model's input it feeds (naming both), then the model called on a few prepared rows as ``model.fit`` gets them,
  each output checked against its label and loss as above.
- :func:`lightning_forward_check` (the same moment, for a LightningModule): Lightning's own ``fast_dev_run`` (one
  training batch, one validation batch, no logger, no checkpoint) of a copy of the module on a few prepared rows
  fed as the ranks feed them, on the driver's CPU; what fails there names the batch's shapes.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any

from spark_hvd.estimators.errors import param_error, param_type_error

__all__ = ["check_not_classes", "keras_forward_check", "lightning_forward_check", "public_name", "torch_forward_check"]

# where the public name of a class lives (torch.nn.modules.loss.CrossEntropyLoss -> torch.nn.CrossEntropyLoss)
_PUBLIC = (("torch.nn.modules.", "torch.nn"), ("torch.optim.", "torch.optim"), ("keras.src.losses", "keras.losses"),
           ("keras.src.optimizers", "keras.optimizers"), ("keras.src.models", "keras"))


def public_name(cls: type) -> str:
    """``module.Class`` as users write it (``torch.nn.CrossEntropyLoss``, ``keras.optimizers.Adam``)."""
    module = getattr(cls, "__module__", "") or ""
    for prefix, public in _PUBLIC:
        if module.startswith(prefix):
            return f"{public}.{cls.__qualname__}"
    return cls.__qualname__ if module in ("__main__", "builtins", "") else f"{module}.{cls.__qualname__}"


def check_not_classes(name: str, framework: str, model: Any, optimizer: Any, loss: Any) -> None:
    """Raise ``TypeError`` when ``model``, ``optimizer`` or a loss is a class rather than an instance.

    Args:
        name: the estimator's name, the start of every message.
        framework: ``"torch"`` or ``"keras"`` (the fix differs).
        model, optimizer, loss: the params (``loss`` may be a list, one per label).
    """
    if inspect.isclass(model):
        raise param_type_error(name, f"model is the class {public_name(model)}, not a model; pass an instance: "
                        f"model={public_name(model)}(...)")
    if inspect.isclass(optimizer):
        cls = public_name(optimizer)
        fix = (f"optimizer={cls}(model.parameters(), lr=1e-3)" if framework == "torch"
               else f"optimizer={cls}(learning_rate=1e-3) (or a name such as 'adam')")
        raise param_type_error(name, f"optimizer is the class {cls}, not an optimizer; build it: {fix}")
    for i, item in enumerate(loss if isinstance(loss, list | tuple) else [loss]):
        if inspect.isclass(item):
            cls = public_name(item)
            where = f"loss {i}" if isinstance(loss, list | tuple) else "loss"
            raise param_type_error(name, f"{where} is the class {cls}, not a loss; pass an instance: {cls}() "
                            "(or a loss name, or a function)")


def torch_forward_check(name: str, spec: Any, label_max: dict[str, float], rows: int = 4) -> None:
    """Call the module of ``spec`` (a ``TorchSpec``) on ``rows`` prepared training rows on the driver, as a rank
    would, and check each output against its label and loss; raise ``ValueError`` naming both numbers.

    ``label_max`` maps a label column to its largest value over the whole DataFrame (the number of classes of a
    class-index loss is that + 1). A ``train_minibatch_fn`` replaces the loss step: then only the forward pass runs.
    """
    import torch

    from spark_hvd.estimators.rank_data import ShardReaders
    from spark_hvd.estimators.torch_precision import MixedPrecision
    from spark_hvd.estimators.torch_rank import TorchTrainer, is_class_index_loss, resolve_losses

    small = dataclasses.replace(spec, batch_size=rows, shuffle=False, train_steps_per_epoch=1)
    gen = ShardReaders(small, 0, 1).epoch("train", 0)
    try:
        batch = next(gen)
    finally:
        gen.close()
    trainer = TorchTrainer()
    trainer.spec, trainer.device = small, torch.device("cpu")
    trainer.precision = MixedPrecision(None, trainer.device)
    from spark_hvd.estimators.torch_serde import deserialize_module

    trainer.model = deserialize_module(spec.model_bytes).eval()
    trainer._build_training(small)
    inputs, labels, weights = trainer._tensors(batch)
    n = len(inputs[0])
    shapes = ", ".join(f"{c} {tuple(t.shape)}" for c, t in zip(spec.feature_cols, inputs, strict=True))
    where = f"on a forward pass of {n} prepared rows on the driver"
    try:
        with torch.no_grad():
            out = trainer.model(*inputs)
    except Exception as exc:
        raise param_error(name, f"the model failed {where} (inputs: {shapes}): {type(exc).__name__}: {exc}. "
                         "Check input_shapes (without the batch dimension) and the first layer's size") from exc
    outputs = list(out) if isinstance(out, list | tuple) else [out]
    if len(outputs) != len(spec.label_cols):
        raise param_error(name, f"the model returns {len(outputs)} outputs for {len(spec.label_cols)} label columns "
                         f"{list(spec.label_cols)}; return one tensor per label (a tuple for several)")
    losses = resolve_losses(spec.loss, len(spec.label_cols))
    for col, o, y, item in zip(spec.label_cols, outputs, labels, losses, strict=True):
        _check_output(name, col, tuple(o.shape), tuple(y.shape), is_class_index_loss(item), _is_elementwise(item),
                      label_max.get(col), "loss='cross_entropy'")
    if spec.train_minibatch_fn is not None:
        return
    try:
        with torch.no_grad():
            outs, fitted = trainer._transform_outputs(outputs, labels)
            trainer._loss(outs, fitted, weights)
    except Exception as exc:
        got = ", ".join(f"output {tuple(o.shape)} vs label {c!r} {tuple(y.shape)}"
                        for c, o, y in zip(spec.label_cols, outputs, labels, strict=True))
        raise param_error(name, f"the loss failed {where} ({got}): {type(exc).__name__}: {exc}") from exc


def lightning_forward_check(name: str, spec: Any, rows: int = 4) -> None:
    """Run Lightning's ``fast_dev_run`` of a copy of the module of ``spec`` (a ``LightningSpec``) on ``rows``
    prepared rows on the driver's CPU, batches as a rank gets them (a dict of tensors by column), with the spec's
    precision and clipping and none of the user's callbacks or loggers; raise ``ValueError`` naming the batch's
    shapes and Lightning's error. The module passed to ``fit`` is not touched (the copy is the spec's bytes)."""
    import logging
    import tempfile
    import warnings

    import lightning.pytorch as pl
    import torch

    from spark_hvd.estimators.lightning_rank import LightningTrainer
    from spark_hvd.estimators.rank_data import ShardReaders
    from spark_hvd.estimators.torch_serde import deserialize_module

    small = dataclasses.replace(spec, batch_size=rows, val_batch_size=rows, shuffle=False, train_steps_per_epoch=1,
                                validation_steps_per_epoch=1)
    readers = ShardReaders(small, 0, 1)
    feeder = LightningTrainer()
    feeder.spec, feeder.device = small, torch.device("cpu")

    def first(split: str) -> dict:
        gen = readers.epoch(split, 0)
        try:
            return feeder._batch(next(gen))
        finally:
            gen.close()

    try:
        train = first("train")
        val = first("val") if readers.has_validation else None
    finally:
        readers.close()
    shapes = ", ".join(f"{c} {tuple(t.shape)}" for c, t in train.items())
    module = deserialize_module(spec.model_bytes)
    settings = {k: v for k, v in (("precision", spec.precision), ("gradient_clip_val", spec.gradient_clip_val))
                if v is not None}
    chatty = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric")]
    levels = [log.level for log in chatty]
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for log in chatty:
            log.setLevel(logging.WARNING)
        try:
            trainer = pl.Trainer(accelerator="cpu", devices=1, fast_dev_run=1, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                 default_root_dir=root, **settings)
            loader = torch.utils.data.DataLoader
            trainer.fit(module, train_dataloaders=loader([train], batch_size=None),
                        val_dataloaders=loader([val], batch_size=None) if val is not None else None)
        except Exception as exc:
            raise param_error(name, f"the LightningModule failed Lightning's fast_dev_run on {rows} prepared rows on "
                              f"the driver (batch: {shapes}): {type(exc).__name__}: {exc}. Check input_shapes "
                              "(without the batch dimension) and the module's layer sizes") from exc
        finally:
            for log, level in zip(chatty, levels, strict=True):
                log.setLevel(level)


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
    from spark_hvd.estimators.keras_serde import deserialize_keras_model
    from spark_hvd.estimators.rank_data import ShardReaders

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
        _check_output(name, col, tuple(o.shape), tuple(label.shape),
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


def _is_elementwise(item: Any) -> bool:
    """Whether a torch loss compares output and label value by value (the built-in regression losses)."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    if isinstance(item, str):
        return item in ("mse", "l1", "bce_with_logits")
    return item in (F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.binary_cross_entropy_with_logits) \
        or isinstance(item, torch.nn.MSELoss | torch.nn.L1Loss | torch.nn.SmoothL1Loss | torch.nn.HuberLoss
                      | torch.nn.BCEWithLogitsLoss)


def _check_output(name: str, col: str, out: tuple, label: tuple, class_index: bool, elementwise: bool,
                  label_max: float | None, class_loss: str) -> None:
    """One output's shape ``out`` against its label's shape ``label`` (both with the batch dimension first)."""
    per_row = math.prod(out[1:]) if len(out) > 1 else 1
    label_per_row = math.prod(label[1:]) if len(label) > 1 else 1
    if class_index:
        if len(out) < 2:
            raise param_error(name, f"label {col!r} takes a class-index loss, which needs one logit per class "
                             f"(rows, classes), but the model gives one value per row (shape {out})")
        if label_max is not None:
            classes = int(label_max) + 1
            width = int(out[-1])
            if width < classes:
                raise param_error(name, f"label {col!r} holds class indices up to {int(label_max)} ({classes} "
                                 f"classes) but the model gives {width} values per row; a class-index loss needs "
                                 f"one logit per class: make the last layer {classes} wide")
        return
    if elementwise and per_row != label_per_row:
        hint = f" For class indices use a class-index loss ({class_loss})." if label_per_row == 1 else ""
        raise param_error(name, f"label {col!r} has {label_per_row} value(s) per row but the model gives "
                         f"{per_row}; the loss compares them value by value, so they must match.{hint}")
