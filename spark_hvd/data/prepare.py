"""Driver side: turn a DataFrame into Parquet files in the store that every training rank can read its share of.

:func:`prepare_data` checks the columns, converts ``Vector`` columns to fixed-length float32 arrays, splits off the
validation rows, writes ``data/<key>/train`` and ``data/<key>/val`` with enough files for every rank, records
``_metadata.json`` and commits the directory atomically. The key is a hash of what the DataFrame computes
(:func:`spark_hvd.data.fingerprint.plan_key`: the canonical plan, UDF bytes, source files' sizes and times), its
schema and the preparation settings: preparing the same data with the same settings again, in this session or a
later one, through a new ``VectorAssembler.transform`` or not, finds the committed dataset and writes nothing.

Sources the key cannot see into (a table format such as Delta, an RDD in another session) are keyed for this
Spark application only; pass ``overwrite=True`` to prepare again when files changed under an unchanged plan.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import os
import posixpath
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spark_hvd.data import arrow_write, errors
from spark_hvd.data.fingerprint import plan_key
from spark_hvd.data.metadata import FORMAT_VERSION, ColumnSpec, DatasetInfo, column_roles

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import DataFrame

    from spark_hvd.store import Store

logger = logging.getLogger(__name__)

_VAL_FLAG = "__spark_hvd_is_val__"
_SCALAR_DTYPES = {
    "boolean": "bool",
    "tinyint": "int8",
    "smallint": "int16",
    "int": "int32",
    "bigint": "int64",
    "float": "float32",
    "double": "float64",
}


#: Seconds a preparation waits for another one into the same store (this process) to end.
PREPARE_WAIT_S = float(os.environ.get("SPARK_HVD_PREPARE_WAIT", str(6 * 3600)))
_STORE_LOCKS: dict[str, threading.Lock] = {}
_STORE_LOCKS_GUARD = threading.Lock()


def _one_at_a_time_per_store(fn: Callable[..., DatasetInfo]) -> Callable[..., DatasetInfo]:
    """Preparations into one store run one after another in this process. Concurrent fits of the same data (a
    ``CrossValidator`` with ``parallelism`` > 1 fits one fold's grid points at once) then find the first one's
    committed dataset and reuse it, instead of each writing it again and replacing it under the others' readers."""

    @functools.wraps(fn)
    def locked(df: DataFrame, store: Store, *args: Any, **kwargs: Any) -> DatasetInfo:
        with _STORE_LOCKS_GUARD:
            lock = _STORE_LOCKS.setdefault(str(store.url), threading.Lock())
        if not lock.acquire(timeout=PREPARE_WAIT_S):
            raise errors.InvalidParamError(f"another preparation into {store!r} in this process did not end "
                                           f"within {PREPARE_WAIT_S:.0f} s (SPARK_HVD_PREPARE_WAIT)")
        try:
            return fn(df, store, *args, **kwargs)
        finally:
            lock.release()

    return locked


@dataclass(frozen=True)
class _Plan:
    name: str
    role: str
    kind: str  # scalar | vector | array | binary | string | sparse  (an array may turn out ragged)
    dtype: str
    spark_type: str
    cast_double: bool = False
    contains_null: tuple[bool, ...] = ()  # per nesting level of an array: may it hold nulls
    depth: int = 0  # nesting depth of an array (array<float>: 1, array<array<float>>: 2)


#: What a used column may be (the message of ``errors.UnsupportedColumnTypeError``).
_SUPPORTED = ("a numeric or boolean scalar, a pyspark.ml.linalg.Vector, binary (encoded images, audio ...), string, "
              "or an array (possibly nested, e.g. array<array<float>>) of numbers; token-id arrays may differ in "
              "length")
#: Kinds whose Parquet row groups are sized by bytes (``row_group_bytes``): their rows vary in size.
_VARIABLE_KINDS = ("binary", "string", "sparse", "ragged")
#: Default row group size for datasets with such columns (Spark's writer default, 128 MiB, would make a rank's
#: read-ahead of a few row groups hold hundreds of MiB of encoded images).
DEFAULT_ROW_GROUP_BYTES = 8 << 20

def _as_list(cols: str | Sequence[str] | None, what: str) -> list[str]:
    if cols is None:
        return []
    if isinstance(cols, str):
        return [cols]
    out = list(cols)
    for c in out:
        if not isinstance(c, str):
            raise errors.InvalidParamError(f"{what} must be column names (strings), got {c!r}")
    return out


def _check_validation(validation: float | str | None) -> None:
    if validation is None or isinstance(validation, str):
        if isinstance(validation, str) and not validation:
            raise errors.ValidationParamError("validation column name is empty")
        return
    if isinstance(validation, bool) or not isinstance(validation, (int, float)):
        raise errors.ValidationParamError(
            f"validation must be a fraction in (0, 1), a column name or None, got {validation!r}"
        )
    if not 0.0 < float(validation) < 1.0:
        raise errors.ValidationParamError(f"validation fraction must be in (0, 1), got {validation}")


def _plan_column(name: str, dtype: Any, role: str, sparse_vectors: str = "dense") -> _Plan:
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    simple = dtype.simpleString()
    if isinstance(dtype, VectorUDT):
        if sparse_vectors == "sparse":
            return _Plan(name, role, "sparse", "float32", "vector")
        return _Plan(name, role, "vector", "float32", "vector")
    if isinstance(dtype, T.DecimalType):
        return _Plan(name, role, "scalar", "float64", simple, cast_double=True)
    if simple in _SCALAR_DTYPES:
        return _Plan(name, role, "scalar", _SCALAR_DTYPES[simple], simple)
    if isinstance(dtype, T.BinaryType):
        return _Plan(name, role, "binary", "object", simple)
    if isinstance(dtype, T.StringType):
        return _Plan(name, role, "string", "object", simple)
    if isinstance(dtype, T.ArrayType):
        nulls = []
        elem: Any = dtype
        while isinstance(elem, T.ArrayType):
            nulls.append(bool(elem.containsNull))
            elem = elem.elementType
        depth = len(nulls)
        if isinstance(elem, T.DecimalType):
            return _Plan(name, role, "array", "float64", simple, cast_double=True, contains_null=tuple(nulls),
                         depth=depth)
        if elem.simpleString() in _SCALAR_DTYPES:
            return _Plan(name, role, "array", _SCALAR_DTYPES[elem.simpleString()], simple,
                         contains_null=tuple(nulls), depth=depth)
    needed = _SUPPORTED
    if isinstance(dtype, T.MapType | T.StructType):
        needed += (f"; select the fields the model needs as columns of their own (df.select('{name}.field') or "
                   "explode the map) first")
    raise errors.UnsupportedColumnTypeError(name, simple, role, needed=needed)


def _fingerprint(df: DataFrame, params: dict[str, Any]) -> str:
    doc = {"plan": plan_key(df), "schema": df.schema.json(), "params": params, "format": FORMAT_VERSION}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def _normalize(
    feature_cols: Any,
    label_cols: Any,
    sample_weight_col: Any,
    validation: Any,
    num_proc: Any,
    partitions_per_process: Any,
    seed: Any,
) -> tuple[list[str], list[str], int, int, int]:
    features = _as_list(feature_cols, "feature_cols")
    labels = _as_list(label_cols, "label_cols")
    if not features:
        raise errors.InvalidParamError("feature_cols is empty: name at least one input column")
    if sample_weight_col is not None and not isinstance(sample_weight_col, str):
        raise errors.InvalidParamError(f"sample_weight_col must be a column name, got {sample_weight_col!r}")
    if int(num_proc) < 1:
        raise errors.InvalidParamError(f"num_proc must be >= 1, got {num_proc}")
    if int(partitions_per_process) < 1:
        raise errors.InvalidParamError(f"partitions_per_process must be >= 1, got {partitions_per_process}")
    _check_validation(validation)
    return features, labels, int(num_proc), int(partitions_per_process), int(seed)


def _params(
    features: list[str],
    labels: list[str],
    weight: str | None,
    validation: float | str | None,
    num_parts: int,
    seed: int,
    compression: str,
    sparse_vectors: str = "dense",
    row_group_bytes: int | None = None,
) -> dict[str, Any]:
    extra: dict[str, Any] = {}  # only where not the default, so that earlier keys stay valid
    if sparse_vectors != "dense":
        extra["sparse_vectors"] = sparse_vectors
    if row_group_bytes is not None:
        extra["row_group_bytes"] = int(row_group_bytes)
    return extra | {
        "features": features,
        "labels": labels,
        "weight": weight,
        "validation": validation,
        "num_parts": num_parts,
        # the seed draws a fractional validation split and nothing else: without one, fits that differ only in
        # their seed (a CrossValidator grid over random_seed) share the dataset
        "seed": seed if isinstance(validation, float) and 0 < validation < 1 else 0,
        "compression": compression,
    }


def dataset_key(df: DataFrame, feature_cols: str | Sequence[str], label_cols: str | Sequence[str] | None = None,
                **settings: Any) -> str:
    """The key :func:`prepare_data` gives the dataset of ``df`` with these settings: ``settings`` are its keyword
    arguments (``sample_weight_col``, ``validation``, ``num_proc``, ``partitions_per_process``, ``seed``,
    ``compression``, ``sparse_vectors``, ``row_group_bytes``; the others key nothing), with its defaults. Nothing
    runs on Spark; an argument ``prepare_data`` does not take raises ``TypeError``."""
    bound = inspect.signature(prepare_data.__wrapped__).bind(df, None, feature_cols, label_cols, **settings)
    bound.apply_defaults()
    return "ds-" + _fingerprint(df, _keyed_params(**{k: v for k, v in bound.arguments.items()
                                                      if k in _KEYED}))[:20]


#: ``prepare_data``'s arguments that the dataset key depends on
_KEYED = ("feature_cols", "label_cols", "sample_weight_col", "validation", "num_proc", "partitions_per_process",
          "seed", "compression", "sparse_vectors", "row_group_bytes")


def _keyed_params(**settings: Any) -> dict[str, Any]:
    """The settings of ``_KEYED`` checked (``_normalize``) and as the key hashes them (``_params``)."""
    features, labels, num_proc, ppp, seed = _normalize(
        settings["feature_cols"], settings["label_cols"], settings["sample_weight_col"], settings["validation"],
        settings["num_proc"], settings["partitions_per_process"], settings["seed"])
    return _params(features, labels, settings["sample_weight_col"], settings["validation"], num_proc * ppp, seed,
                   settings["compression"], settings["sparse_vectors"], settings["row_group_bytes"])


@_one_at_a_time_per_store
def prepare_data(
    df: DataFrame,
    store: Store,
    feature_cols: str | Sequence[str],
    label_cols: str | Sequence[str] | None = None,
    sample_weight_col: str | None = None,
    validation: float | str | None = None,
    num_proc: int = 1,
    partitions_per_process: int = 10,
    seed: int = 0,
    compression: str = "snappy",
    overwrite: bool = False,
    visibility_timeout_s: float | None = None,
    sparse_vectors: str = "dense",
    row_group_bytes: int | None = None,
) -> DatasetInfo:
    """Write the columns a training job needs to Parquet in ``store`` and return the dataset's metadata.

    Args:
        df: the DataFrame to train on.
        store: where the files go (a :class:`~spark_hvd.store.Store` that Spark can write to).
        feature_cols: the model's input column(s).
        label_cols: the target column(s) (may be empty for unsupervised models).
        sample_weight_col: a numeric column of per-row weights, or ``None``.
        validation: ``None``; a fraction in (0, 1) of rows drawn at random (reproducibly from ``seed``) as the
            validation split; or the name of a boolean or numeric column whose true (> 0) rows are validation.
        num_proc: the number of training processes that will read the data.
        partitions_per_process: files (hence at least row groups) per process: each split is written as
            ``num_proc * partitions_per_process`` Parquet files so that every rank gets a fair share.
        seed: seed of the random validation split.
        compression: Parquet compression codec.
        overwrite: prepare again even when the cache holds a dataset for the same DataFrame and settings.
        visibility_timeout_s: how long to wait for Spark's files to be visible (DBFS); the store's default if None.
        sparse_vectors: ``"dense"`` (default): Vector columns are stored as dense float32 arrays; ``"sparse"``:
            stored as Spark writes them (size, indices, values) and handed to the ranks as
            ``scipy.sparse.csr_matrix`` batches (see :class:`~spark_hvd.data.reader.BatchReader`).
        row_group_bytes: target size of a Parquet row group in bytes, whatever the row count; default
            ``DEFAULT_ROW_GROUP_BYTES`` (8 MiB) for datasets with binary, string, ragged or sparse columns, Spark's
            default (128 MiB) otherwise.

    Columns may be numeric or boolean scalars; ``pyspark.ml.linalg`` Vectors (see ``sparse_vectors``); ``binary``
    (encoded images, audio: handed to the ranks as Python ``bytes``); ``string`` (as Python ``str``; string
    categories are indexed with ``pyspark.ml.feature.StringIndexer`` in the Pipeline first); arrays of numbers
    of one fixed length, nested or not (``array<array<float>>`` becomes an ``(rows, d1, d2)`` array); 1-D
    arrays of numbers that differ in length (token ids: kind ``"ragged"``, padded per batch by the reader).
    Maps and structs are refused, naming the column. Everything is checked before anything is written
    (missing columns with the closest names suggested, unsupported types, nulls, nested arrays of different
    shapes, an empty DataFrame, a bad ``validation``, fewer rows than ``num_proc``); a failure leaves nothing
    in the store.

    Returns:
        The :class:`~spark_hvd.data.metadata.DatasetInfo` (also at ``store.metadata_path(info.key)``); its
        ``extra["label_max"]`` holds the largest value of each numeric scalar label column (from the checks' pass:
        an estimator's pre-flight takes the number of classes from it, with no Spark job of its own).

    Raises:
        spark_hvd.data.errors.DataError: a subclass naming the column or parameter at fault.
    """
    from pyspark.sql import functions as F
    from pyspark.sql.types import BooleanType

    features, labels, num_proc, partitions_per_process, seed = _normalize(
        feature_cols, label_cols, sample_weight_col, validation, num_proc, partitions_per_process, seed
    )

    # -- columns: exist, supported types (from the schema only: nothing runs yet)
    roles = column_roles(features, labels, sample_weight_col)
    fields = {f.name: f.dataType for f in df.schema.fields}
    for name, role in roles.items():
        if name not in fields:
            raise errors.ColumnNotFoundError(name, list(fields), role)
    if isinstance(validation, str) and validation not in fields:
        raise errors.ColumnNotFoundError(validation, list(fields), "validation column")
    if sparse_vectors not in ("dense", "sparse"):
        raise errors.InvalidParamError(f"sparse_vectors must be 'dense' or 'sparse', got {sparse_vectors!r}")
    if row_group_bytes is not None and int(row_group_bytes) < 1:
        raise errors.InvalidParamError(f"row_group_bytes must be a positive number of bytes, got {row_group_bytes!r}")
    plans = [_plan_column(name, fields[name], role, sparse_vectors) for name, role in roles.items()]
    if sample_weight_col:
        w = next(p for p in plans if p.name == sample_weight_col)
        if w.kind != "scalar":
            raise errors.UnsupportedColumnTypeError(sample_weight_col, w.spark_type, "sample weight column")
    if isinstance(validation, str):
        vtype = fields[validation].simpleString()
        if vtype not in _SCALAR_DTYPES and not vtype.startswith("decimal"):
            raise errors.ValidationParamError(
                f"validation column {validation!r} has type {fields[validation].simpleString()}; "
                "it must be boolean or numeric (true or > 0 marks a validation row)"
            )

    num_parts = num_proc * partitions_per_process
    params = _params(features, labels, sample_weight_col, validation, num_parts, seed, compression,
                     sparse_vectors, row_group_bytes)
    fingerprint = _fingerprint(df, params)
    key = "ds-" + fingerprint[:20]
    data_path = store.data_path(key)
    if not overwrite and store.is_committed(data_path):
        info = DatasetInfo.load(store, key)
        logger.info("reusing prepared dataset %s in %r (same DataFrame and settings)", key, store)
        _mark_used(store, key)
        return info

    # -- one pass over the data for every check
    def col(name: str) -> Any:
        return F.col("`" + name.replace("`", "``") + "`")

    def vector_as_array(p: _Plan) -> Any:
        from pyspark.ml.functions import vector_to_array

        return vector_to_array(col(p.name), "float32")

    aggs = [F.count(F.lit(1)).alias("n")]
    for i, p in enumerate(plans):
        aggs.append(F.sum(F.when(col(p.name).isNull(), 1).otherwise(0)).alias(f"null{i}"))
        if p.kind in ("vector", "sparse"):
            size = F.size(vector_as_array(p))
            aggs += [F.min(size).alias(f"min{i}_1"), F.max(size).alias(f"max{i}_1")]
        elif p.kind == "array":
            aggs += _array_checks(col(p.name), p, i)
    if isinstance(validation, str):
        vcol = col(validation)
        flag = vcol if isinstance(fields[validation], BooleanType) else (vcol > 0)
        aggs.append(F.sum(F.when(vcol.isNull(), 1).otherwise(0)).alias("vnull"))
        aggs.append(F.sum(F.when(flag, 1).otherwise(0)).alias("nval"))
    elif validation is not None:
        flag = F.rand(seed) < float(validation)
    # the largest value of each numeric scalar label (an estimator's pre-flight reads its number of classes)
    maxed = [p.name for p in plans if p.name in labels and p.kind == "scalar" and p.spark_type != "boolean"]
    aggs += [F.max(col(name)).alias(f"lmax{i}") for i, name in enumerate(maxed)]
    stats = df.agg(*aggs).collect()[0].asDict()

    total = int(stats["n"])
    if total == 0:
        raise errors.EmptyDataFrameError("the DataFrame has no rows: there is nothing to train on")
    nulls = {p.name: int(stats[f"null{i}"]) for i, p in enumerate(plans) if stats[f"null{i}"]}
    if isinstance(validation, str) and stats["vnull"]:
        nulls[validation] = int(stats["vnull"])
    if nulls:
        detail = ", ".join(f"{roles.get(c, 'validation column')} {c!r}: {n} of {total} rows" for c, n in nulls.items())
        raise errors.NullValuesError(f"null values in used columns ({detail}); drop or fill them first "
                                     "(df.na.drop/fill)")
    shapes: dict[str, tuple[int, ...]] = {}
    kinds: dict[str, str] = {}
    for i, p in enumerate(plans):
        shapes[p.name], kinds[p.name] = _shape(p, i, stats)
    if total < num_proc:
        raise errors.TooFewRowsError(f"the DataFrame has {total} rows, fewer than num_proc={num_proc}: some rank "
                                     "gets none")
    if isinstance(validation, str):
        nval = int(stats["nval"] or 0)
        for split, rows in (("validation", nval), ("training", total - nval)):
            if rows < num_proc:
                raise errors.TooFewRowsError(
                    f"validation column {validation!r} leaves {rows} {split} rows, fewer than num_proc={num_proc}"
                )

    # -- the projected, converted DataFrame and its split
    out_cols = []
    for p in plans:
        if p.kind == "vector":
            out_cols.append(vector_as_array(p).alias(p.name))
        elif p.cast_double:
            out_cols.append(col(p.name).cast("array<" * p.depth + "double" + ">" * p.depth).alias(p.name))
        else:
            out_cols.append(col(p.name))
    if validation is None:
        splits = {"train": df.select(*out_cols)}
    else:
        flagged = df.select(*out_cols, flag.alias(_VAL_FLAG))
        splits = {
            "train": flagged.filter(~F.col(_VAL_FLAG)).drop(_VAL_FLAG),
            "val": flagged.filter(F.col(_VAL_FLAG)).drop(_VAL_FLAG),
        }

    columns = {p.name: ColumnSpec(p.name, p.dtype, shapes[p.name], kinds[p.name], p.spark_type) for p in plans}
    if row_group_bytes is None and any(k in _VARIABLE_KINDS for k in kinds.values()):
        row_group_bytes = DEFAULT_ROW_GROUP_BYTES
    timeout = visibility_timeout_s
    with store.atomic_dir(data_path, overwrite=True) as target:
        if arrow_write.chosen(store, list(kinds.values()), compression):
            logger.info("writing dataset %s to %s from Spark's Python workers (%d files per split)", key, target,
                        num_parts)
            counts = arrow_write.write_splits(splits, store, target, num_parts, num_proc, compression,
                                              _float_column_paths(plans), row_group_bytes)
        else:
            counts = _write_with_spark(splits, store, target, key, num_parts, compression, row_group_bytes, plans,
                                       timeout)
        if counts["train"] < num_proc:
            raise errors.TooFewRowsError(
                f"the training split has {counts['train']} rows, fewer than num_proc={num_proc}; "
                "use a smaller validation share or more data"
            )
        if validation is not None and counts["val"] < num_proc:
            raise errors.TooFewRowsError(
                f"the validation split ({validation!r}) has {counts['val']} rows, fewer than num_proc={num_proc}; "
                "use a larger validation share, more data, or validation=None"
            )
        info = DatasetInfo(
            key=key,
            columns=columns,
            feature_cols=features,
            label_cols=labels,
            sample_weight_col=sample_weight_col,
            train_rows=counts["train"],
            val_rows=counts.get("val", 0),
            num_partitions=num_parts,
            validation=validation,
            seed=seed,
            fingerprint=fingerprint,
            extra={"label_max": {name: float(stats[f"lmax{i}"]) for i, name in enumerate(maxed)}},
        )
        store.write_bytes(posixpath.join(target, "_metadata.json"), info.dumps().encode("utf-8"))
    logger.info("prepared dataset %s: %d train rows, %d validation rows", key, info.train_rows, info.val_rows)
    _mark_used(store, key)
    return info


def _write_with_spark(splits: dict[str, Any], store: Store, target: str, key: str, num_parts: int, compression: str,
                      row_group_bytes: int | None, plans: Sequence[_Plan], timeout: float | None) -> dict[str, int]:
    """Each split written by Spark's Parquet writer (where ``arrow_write`` does not run); its rows, from the
    footers."""
    counts = {}
    for split, sdf in splits.items():
        out = posixpath.join(target, split)
        logger.info("writing %s split of dataset %s to %s (%d files)", split, key, out, num_parts)
        writer = sdf.repartition(num_parts).write.mode("overwrite").option("compression", compression)
        if row_group_bytes:
            writer = _row_groups_by_bytes(writer, row_group_bytes)
        writer = _plain_floats(writer, plans)
        writer.parquet(store.spark_url(out))
        store.wait_until_visible(out, timeout_s=timeout)
        counts[split] = _count_rows(store, out)
    return counts


def _mark_used(store: Store, key: str) -> None:
    """Record the use for ``Store.clean`` (a failure to record only warns: the fit does not need it)."""
    from spark_hvd.store.hygiene import mark_dataset_used

    try:
        mark_dataset_used(store, key)
    except Exception as exc:  # pragma: no cover - a store that took the data but not this small file
        logger.warning("could not record the use of dataset %s in %r (%s); Store.clean may delete it early",
                       key, store, exc)


def _array_checks(c: Any, p: _Plan, i: int) -> list[Any]:
    """Aggregates of an array column: min/max length at each nesting level, rows with null elements."""
    from pyspark.sql import functions as F

    aggs = [F.min(F.size(c)).alias(f"min{i}_1"), F.max(F.size(c)).alias(f"max{i}_1")]
    outer, level = None, c  # level: the arrays of nesting level k of a row, flattened into one array
    for k in range(1, p.depth + 1):
        if outer is not None:  # the sizes of the level-k arrays are those of the elements of level k - 1
            sizes = F.transform(outer, lambda x: F.size(x))
            aggs += [F.min(F.array_min(sizes)).alias(f"min{i}_{k}"), F.max(F.array_max(sizes)).alias(f"max{i}_{k}")]
        if p.contains_null[k - 1]:
            has_null = F.exists(level, lambda x: x.isNull())
            aggs.append(F.sum(F.when(has_null, 1).otherwise(0)).alias(f"elnull{i}_{k}"))
        if k < p.depth:
            outer, level = level, F.flatten(level)
    return aggs


def _shape(p: _Plan, i: int, stats: dict[str, Any]) -> tuple[tuple[int, ...], str]:
    """The per-row shape and the final kind of a planned column, from the aggregates (raises on bad data)."""
    if p.kind in ("scalar", "binary", "string"):
        return (), p.kind
    depth = max(p.depth, 1)
    for k in range(1, depth + 1):
        if stats.get(f"elnull{i}_{k}"):
            what = "null elements" if k == depth else f"null arrays at nesting level {k + 1}"
            raise errors.NullValuesError(f"{p.role} {p.name!r}: {stats[f'elnull{i}_{k}']} rows hold arrays with {what}")
    dims = []
    for k in range(1, depth + 1):
        lo, hi = stats.get(f"min{i}_{k}"), stats.get(f"max{i}_{k}")
        lo, hi = int(lo if lo is not None else 0), int(hi if hi is not None else 0)
        if lo != hi:
            if p.kind == "array" and depth == 1:  # token ids, signals: kept ragged
                return (-1,), "ragged"
            where = "" if k == 1 else f" at nesting level {k}"
            raise errors.InconsistentShapeError(
                f"{p.role} {p.name!r} holds {p.kind}s of different lengths{where} ({lo} to {hi}); "
                + ("every row needs the same length" if p.kind != "array" else
                   "nested arrays need one fixed shape (only 1-D arrays may differ in length)")
            )
        if lo == 0:
            raise errors.InconsistentShapeError(f"{p.role} {p.name!r} holds empty {p.kind}s")
        dims.append(lo)
    return tuple(dims), p.kind


def _row_groups_by_bytes(writer: Any, row_group_bytes: int) -> Any:
    """Size the writer's Parquet row groups by bytes: Parquet's writer checks the buffered size after a number of
    rows it estimates (``parquet.page.size.row.check.min``, 100 by default: 100 rows of 1 MiB images would make a
    100 MiB row group)."""
    return (writer.option("parquet.block.size", str(int(row_group_bytes)))
            .option("parquet.page.size.row.check.min", "2")
            .option("parquet.page.size.row.check.max", "1000"))


def _float_column_paths(plans: Sequence[_Plan]) -> list[str]:
    """The Parquet column paths (Spark's standard list layout) of the float and double values the write stores:
    scalars, dense vectors (float32 arrays) and arrays at any depth."""
    paths = []
    for p in plans:
        if p.dtype in ("float32", "float64") and p.kind in ("scalar", "vector", "array"):
            depth = 1 if p.kind == "vector" else p.depth
            paths.append(p.name + ".list.element" * depth)
    return paths


def _plain_floats(writer: Any, plans: Sequence[_Plan]) -> Any:
    """No dictionary encoding for float columns. Parquet's writer dictionary-encodes every column, and a column
    of measured floats (features, embeddings, regression targets) has nearly as many distinct values as rows: at the
    end of each column chunk the writer finds the dictionary no smaller and encodes the values again as PLAIN, so
    the files are the same and the write did the encoding twice (about half of a first fit's write for a 32-float
    feature array, one pair of runs in ``benchmarks/RESULTS.md``). A float column of a few values (0/1 labels as
    doubles) is stored PLAIN too: somewhat larger files, read as fast. Integer, boolean, string and binary columns
    (class labels, categories, token ids) keep it. Spark's legacy list layout
    (``spark.sql.parquet.writeLegacyFormat``) names the paths differently: there the option matches nothing and the
    writer does as before."""
    for path in _float_column_paths(plans):
        writer = writer.option(f"parquet.enable.dictionary#{path}", "false")
    return writer


def _count_rows(store: Store, path: str) -> int:
    """Rows in the Parquet files under ``path``, from their footers."""
    import pyarrow.dataset as ds

    dataset = ds.dataset(path, format="parquet", filesystem=store.pyarrow_filesystem())
    return int(sum(frag.metadata.num_rows for frag in dataset.get_fragments()))
