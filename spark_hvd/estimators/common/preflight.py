"""Driver-side pre-flight: the mistakes a new user makes, caught before any training task starts.

Two kinds of model checks, raised on the driver with the estimator's name, what was wrong and the fix:

- :func:`check_not_classes` (before any Spark job): a class passed where an instance is wanted
  (``loss=torch.nn.CrossEntropyLoss``, ``optimizer=torch.optim.Adam``, ``model=MyNet``), which otherwise fails
  30 s later on a rank in the framework's words ("Boolean value of Tensor ... is ambiguous").
- the forward check (after the data is prepared, before the ranks start): the model called on a few prepared rows
  exactly as a rank feeds them, each output against its label (:func:`check_output`, shared); one per framework,
  in ``torch/preflight.py``, ``keras/preflight.py`` and ``lightning/preflight.py``.

And the checks of ``fit``'s input that need the DataFrame or the prepared data: the columns exist
(:func:`check_columns`), rows and no nulls (:func:`check_rows`, one Spark job), ``label_shapes`` against the stored
labels (:func:`checked_label_shapes`), ``transformation_fn`` / ``collate_fn`` on the first rows
(:func:`check_batch_functions_on_driver`).
"""

from __future__ import annotations

import inspect
import math
from typing import TYPE_CHECKING, Any

from spark_hvd.estimators.common.errors import param_error, param_type_error

if TYPE_CHECKING:
    from spark_hvd.estimators.common.spec import TrainSpec

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


def checked_label_shapes(name: str, shapes: list[list[int]] | None, data: Any) -> tuple | None:
    """``label_shapes`` as the ranks take them, each checked against its label's stored size per row (the
    prepared data's metadata) before anything runs."""
    if shapes is None:
        return None
    import math

    for col, shape in zip(data.label_cols, shapes, strict=True):
        stored = list(data.columns[col].shape)
        if math.prod(stored) != math.prod(shape):
            raise param_error(name, f"label_shapes: label column {col!r} holds {math.prod(stored)} values per row "
                              f"(shape {stored}), which shape {list(shape)} does not fit")
    return tuple(tuple(s) for s in shapes)


def check_batch_functions_on_driver(spec: TrainSpec) -> None:
    """``transformation_fn`` / ``collate_fn`` tried on the driver on the first rows, before any task starts: a
    decoder that drops a column or returns rows of different shapes fails here, naming the column."""
    from spark_hvd.data.transform_check import TransformationFnError, check_batch_functions

    if spec.transformation_fn is None and spec.collate_fn is None:
        for col in list(spec.feature_cols) + list(spec.label_cols):
            kind = spec.dataset.columns[col].kind
            if kind in ("binary", "string", "sparse"):
                raise TransformationFnError(
                    f"column {col!r} is {kind}: the model needs numbers, so set transformation_fn to decode it "
                    "on the ranks (e.g. spark_hvd.data.decode.ImageDecoder for images, a tokenizer for text) or "
                    "collate_fn to turn each batch into arrays; string categories go through "
                    "pyspark.ml.feature.StringIndexer in the Pipeline")
        return

    cols = list(spec.feature_cols) + list(spec.label_cols)
    if spec.sample_weight_col:
        cols.append(spec.sample_weight_col)
    check_batch_functions(spec.store, spec.dataset, cols, cols, spec.transformation_fn, spec.collate_fn)


def check_rows(df: Any, name: str, cols: list[str], labels: list[str] = ()) -> dict[str, float]:
    """One Spark job, before anything is written: the DataFrame has rows and no nulls in the columns training reads.
    Returns the largest value of each numeric scalar label column (the pre-flight's number of classes)."""
    from pyspark.sql import functions as F  # noqa: N812
    from pyspark.sql.types import NumericType

    numeric = [c for c in labels if isinstance(df.schema[c].dataType, NumericType)]
    aggs = [F.count(F.lit(1)).alias("rows")] + [F.sum(F.col(c).isNull().cast("long")).alias(f"n{i}")
                                                 for i, c in enumerate(cols)]
    aggs += [F.max(F.col(c)).alias(f"max{i}") for i, c in enumerate(numeric)]
    counts = df.agg(*aggs).collect()[0]
    if not counts["rows"]:
        raise param_error(name, "the DataFrame given to fit is empty")
    nulls = {c: counts[f"n{i}"] for i, c in enumerate(cols) if counts[f"n{i}"]}
    if nulls:
        raise param_error(name, f"null values in column(s) {nulls} (column: rows); drop or fill them before fit "
                          "(df.na.drop(subset=[...]) or df.na.fill(...))")
    return {c: float(counts[f"max{i}"]) for i, c in enumerate(numeric)}


def check_columns(df: Any, wanted: list[tuple[str, str]]) -> None:
    """Every (param, column) must name a column of ``df``; the error suggests the nearest existing names."""
    import difflib

    names = df.columns
    for param, col in wanted:
        if col not in names:
            near = difflib.get_close_matches(col, names, n=3)
            hint = f"; did you mean {near}?" if near else ""
            raise ValueError(f"{param}: column {col!r} is not in the DataFrame (columns: {names}){hint}")
