"""Spark ML's classifier columns for a fitted model: ``prediction`` (the class as a double) and ``probability``
(a ``Vector``), so ``MulticlassClassificationEvaluator``, ``BinaryClassificationEvaluator`` and ``CrossValidator``
work on a ``TorchModel``/``KerasModel`` as on Spark's own classifiers.

The estimator records in the model's metadata what its single output is, judged from the loss it was trained with
(:func:`torch_kind`, :func:`keras_kind`):

=======================  =====================================  =======================  ==========================
kind                     loss                                   probability              prediction
=======================  =====================================  =======================  ==========================
``logits``               cross_entropy, nll, Keras SCCE(logits) softmax of the output    arg-max
``probabilities``        Keras sparse_categorical_crossentropy  the output, normalised   arg-max
``binary_logits``        bce_with_logits, Keras BCE(logits)     [1 - sigmoid, sigmoid]   output > 0
``binary_probabilities`` Keras binary_crossentropy              [1 - p, p]               output > 0.5
=======================  =====================================  =======================  ==========================

``nll_loss`` takes log-probabilities; their softmax is the probabilities as well, so it counts as ``logits``.
``transform`` (and the MLflow pyfunc) compute the two columns in numpy inside the same Arrow function that runs the
model (:func:`classifier_arrays`), one pass over each batch; :func:`add_classifier_columns` computes the same
values as Spark SQL expressions on a raw output column (for a DataFrame scored elsewhere). The raw output column
stays as it was.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["KINDS", "add_classifier_columns", "classifier_arrays", "classifier_columns", "keras_kind",
           "torch_kind"]

KINDS = ("logits", "probabilities", "binary_logits", "binary_probabilities")


def torch_kind(loss: Any) -> str | None:
    """The kind of a torch model's output trained with ``loss`` (a name or a callable), or None."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    if isinstance(loss, list | tuple):
        loss = loss[0] if len(loss) == 1 else None
    if isinstance(loss, str):
        return {"cross_entropy": "logits", "bce_with_logits": "binary_logits"}.get(loss)
    if loss in (F.cross_entropy, F.nll_loss) or isinstance(loss, torch.nn.CrossEntropyLoss | torch.nn.NLLLoss):
        return "logits"
    if loss is F.binary_cross_entropy_with_logits or isinstance(loss, torch.nn.BCEWithLogitsLoss):
        return "binary_logits"
    return None


def keras_kind(loss: Any) -> str | None:
    """The kind of a Keras model's output trained with ``loss`` (a name, a ``keras.losses.Loss`` or a function)."""
    if isinstance(loss, list | tuple):
        loss = loss[0] if len(loss) == 1 else None
    if loss is None:
        return None
    if isinstance(loss, str):
        name, logits = loss, False
    else:
        get_config = getattr(loss, "get_config", None)
        config = get_config() if callable(get_config) and not isinstance(loss, type) else {}
        name = str(config.get("name") or getattr(loss, "__name__", "")).lower()
        logits = bool(config.get("from_logits", False))
    if name in ("sparse_categorical_crossentropy", "sparsecategoricalcrossentropy"):
        return "logits" if logits else "probabilities"
    if name in ("binary_crossentropy", "binarycrossentropy"):
        return "binary_logits" if logits else "binary_probabilities"
    return None


def add_classifier_columns(df: Any, output_col: str, kind: str, prediction_col: str, probability_col: str) -> Any:
    """``df`` with ``prediction_col`` (double) and ``probability_col`` (Vector) computed from ``output_col``
    (an ``array<float>`` of per-class values, or a double for a binary model); an empty name leaves that one out."""
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F  # noqa: N812

    if kind not in KINDS:
        raise ValueError(f"unknown classifier kind {kind!r}; one of {list(KINDS)}")
    out = F.col(f"`{output_col}`")
    cols = {}
    if kind.startswith("binary"):
        is_array = df.schema[output_col].dataType.simpleString().startswith("array")
        value = (out[0] if is_array else out).cast("double")
        p1 = 1.0 / (1.0 + F.exp(-value)) if kind == "binary_logits" else value
        threshold = 0.0 if kind == "binary_logits" else 0.5
        cols[prediction_col] = F.when(value > threshold, 1.0).otherwise(0.0)
        cols[probability_col] = array_to_vector(F.array(1.0 - p1, p1))
    else:
        if kind == "logits":
            top = F.array_max(out)
            weights = F.transform(out, lambda x: F.exp(x - top))
        else:
            weights = F.transform(out, lambda x: x.cast("double"))
        total = F.aggregate(weights, F.lit(0.0), lambda acc, x: acc + x)
        # call_function: array_position takes a Column as its value only from pyspark 4.0 (3.5 wants a literal)
        argmax = F.call_function("array_position", out, F.array_max(out)) - 1
        cols[prediction_col] = argmax.cast("double")
        cols[probability_col] = array_to_vector(F.transform(weights, lambda x: x / total))
    return df.withColumns({name: col for name, col in cols.items() if name})


def classifier_columns(output: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """``(prediction, probability)`` of a classifier's raw output for ``n`` rows, as float64 arrays of shape
    ``(n,)`` and ``(n, classes)``: the values :func:`add_classifier_columns` computes on the output column as
    ``transform`` writes it (``array<float>``: float32 values, the logits' shift by their maximum in float32 as Spark
    subtracts two floats; a double where the model gives one value per row)."""
    if kind not in KINDS:
        raise ValueError(f"unknown classifier kind {kind!r}; one of {list(KINDS)}")
    out = np.asarray(output)
    per_row = out.reshape(len(out), -1)
    # the output column's own dtype: one value per row is a double column, several an array<float>
    x = per_row.astype(np.float64 if per_row.shape[1] == 1 else np.float32, copy=False)
    if kind.startswith("binary"):
        value = x[:, 0].astype(np.float64)
        p1 = 1.0 / (1.0 + np.exp(-value)) if kind == "binary_logits" else value
        prediction = (value > (0.0 if kind == "binary_logits" else 0.5)).astype(np.float64)
        return prediction, np.stack([1.0 - p1, p1], axis=1)
    if kind == "logits":
        weights = np.exp((x - x.max(axis=1, keepdims=True)).astype(np.float64)) if x.size else x.astype(np.float64)
    else:
        weights = x.astype(np.float64)
    return x.argmax(axis=1).astype(np.float64), weights / weights.sum(axis=1, keepdims=True)


def classifier_arrays(output: np.ndarray, kind: str, vector: bool) -> tuple[Any, Any]:
    """:func:`classifier_columns` as Arrow arrays: ``prediction`` (double) and ``probability``, as the struct of
    Spark's ``VectorUDT`` (a dense Vector: what ``transform``'s ``mapInArrow`` declares) with ``vector``, else as
    ``list<double>`` (the pyfunc: no Spark there)."""
    import pyarrow as pa

    prediction, probability = classifier_columns(output, kind)
    n, k = probability.shape
    offsets = pa.array(np.arange(n + 1, dtype=np.int32) * k)
    values = pa.ListArray.from_arrays(offsets, pa.array(probability.reshape(-1)))
    if vector:  # VectorUDT.sqlType(): type 1 = dense, size and indices null
        values = pa.StructArray.from_arrays(
            [pa.array(np.ones(n, np.int8)), pa.nulls(n, pa.int32()), pa.nulls(n, pa.list_(pa.int32())), values],
            names=["type", "size", "indices", "values"])
    return pa.array(prediction), values
