"""Driver-side pre-flight: the mistakes a new user makes, caught before any training task starts.

Two kinds, raised on the driver with the estimator's name, what was wrong and the fix:

- :func:`check_not_classes` (before any Spark job): a class passed where an instance is wanted
  (``loss=torch.nn.CrossEntropyLoss``, ``optimizer=torch.optim.Adam``, ``model=MyNet``), which otherwise fails
  30 s later on a rank in the framework's words ("Boolean value of Tensor ... is ambiguous").
- the forward check (after the data is prepared, before the ranks start): the model called on a few prepared rows
  exactly as a rank feeds them, each output against its label (:func:`check_output`, shared); one per framework,
  in ``torch/preflight.py``, ``keras/preflight.py`` and ``lightning/preflight.py``.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

from spark_hvd.estimators.common.errors import param_error, param_type_error

__all__ = ["check_not_classes", "check_output", "public_name"]

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


def check_output(name: str, col: str, out: tuple, label: tuple, class_index: bool, elementwise: bool,
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
