"""Driver side: train on Parquet that is already there, without copying it (``fit_on_parquet``).

:func:`describe_parquet` reads the footers and the used columns of a Parquet directory in the store's filesystem
and returns a :class:`~spark_hvd.data.metadata.DatasetInfo` whose paths point at that directory, so the training
ranks read the user's files in place. It takes the column kinds ``fit(df)`` prepares, where the files already hold
them as the reader reads them: numeric or boolean scalars; ``binary`` (encoded images ...) and ``string`` columns,
handed to ``transformation_fn`` / ``collate_fn`` as ``bytes`` / ``str``; lists of numbers of one fixed shape (nested
included, e.g. ``array<array<float>>``), or 1-D lists that differ in length (token ids: kind ``"ragged"``, padded per
batch as ``fit(df)`` does); no nulls at any depth. It names the column and the type it needs otherwise. Nothing is
written: where a column needs converting (Spark ML Vectors, decimals), ``fit(df)`` prepares a copy.

A dataset written by petastorm (a Unischema in its ``_common_metadata``) is read as petastorm reads it: a column
that ``NdarrayCodec``, ``CompressedNdarrayCodec`` or ``CompressedImageCodec`` encoded is a fixed-shape array of the
field's dtype (``spark_hvd.data.petastorm_dataset``), decoded on the ranks.

A Delta table's current files can be read the same way only through ``delta-spark`` (the transaction log says which
files are current); spark_hvd does not depend on it, so a Delta table must be given to ``fit(spark.read.format(
"delta").load(path))``, which prepares a copy.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from spark_hvd.data.errors import (
    ColumnNotFoundError,
    DatasetNotFoundError,
    EmptyDataFrameError,
    InconsistentShapeError,
    NullValuesError,
    TooFewRowsError,
    UnsupportedColumnTypeError,
)
from spark_hvd.data.metadata import FORMAT_VERSION, ColumnSpec, DatasetInfo, column_roles
from spark_hvd.data.petastorm_dataset import codec_column_spec, dataset_codecs

if TYPE_CHECKING:  # pragma: no cover
    from spark_hvd.store import Store

__all__ = ["describe_parquet"]

_NEEDED = ("a numeric or boolean scalar (float, double, tinyint..bigint, boolean), binary, string, or an array of "
           "such numbers (nested arrays of one fixed shape; 1-D arrays may differ in length), without nulls,")


def store_path(store: Store, path: str) -> str:
    """``path`` (a store path, or a URL of the store's scheme such as ``file:///data/t``) as a store path."""
    return store.fs._strip_protocol(path).rstrip("/") or "/"


def describe_parquet(store: Store, path: str, feature_cols: Sequence[str], label_cols: Sequence[str],
                     sample_weight_col: str | None = None, validation_path: str | None = None,
                     num_proc: int = 1) -> DatasetInfo:
    """The :class:`DatasetInfo` of the Parquet directory ``path`` (and ``validation_path``), read in place.

    Checks, from the footers and one read of the used columns: every column exists, has a type the reader takes
    as it is, no nulls at any depth, nested arrays of one fixed shape (1-D arrays of differing lengths are
    ``"ragged"``); at least ``num_proc`` rows and row groups per split (the ranks
    shard by row group).

    Raises:
        spark_hvd.data.errors.DataError: a subclass naming the column, the file set and what is needed.
    """
    roles = column_roles(feature_cols, label_cols, sample_weight_col)
    paths = {"train": store_path(store, path)}
    if validation_path:
        paths["val"] = store_path(store, validation_path)
    columns: dict[str, ColumnSpec] = {}
    rows: dict[str, int] = {}
    codecs: dict[str, dict] = {}
    for split, split_path in paths.items():
        split_columns, rows[split] = _describe_split(store, split_path, roles, num_proc)
        split_codecs = dataset_codecs(split_path, store.pyarrow_filesystem(), list(roles))
        for name, codec in split_codecs.items():  # petastorm's encoded columns: arrays once decoded
            split_columns[name] = codec_column_spec(name, codec)
        if split != "train" and split_codecs != {n: c for n, c in codecs.items() if n in split_codecs}:
            raise InconsistentShapeError(f"the petastorm codecs of {split_path!r} ({split_codecs}) differ from "
                                         f"those of {paths['train']!r} ({codecs})")
        codecs.update(split_codecs)
        for name, spec in split_columns.items():
            if name in columns and {columns[name].kind, spec.kind} == {"array", "ragged"} and \
                    columns[name].spark_type == spec.spark_type and len(columns[name].shape) == 1:
                spec = columns[name] if columns[name].kind == "ragged" else spec  # one split's rows happen to agree
            if name in columns and columns[name] != spec:
                raise InconsistentShapeError(f"{roles[name]} {name!r} is {columns[name].spark_type} of shape "
                                             f"{list(columns[name].shape)} in {paths['train']!r} but "
                                             f"{spec.spark_type} of shape {list(spec.shape)} in {split_path!r}")
            columns[name] = spec
    if sample_weight_col and columns[sample_weight_col].kind != "scalar":
        raise UnsupportedColumnTypeError(sample_weight_col, columns[sample_weight_col].spark_type,
                                         "sample weight column")
    doc = {"paths": paths, "columns": [c.to_json() for c in columns.values()], "rows": rows,
           "format": FORMAT_VERSION, **({"codecs": codecs} if codecs else {})}
    fingerprint = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
    return DatasetInfo(
        key="pq-" + fingerprint[:20], columns=columns, feature_cols=list(feature_cols), label_cols=list(label_cols),
        sample_weight_col=sample_weight_col, train_rows=rows["train"], val_rows=rows.get("val", 0),
        num_partitions=0, validation=paths.get("val"), fingerprint=fingerprint,
        extra={"train_path": paths["train"], **({"val_path": paths["val"]} if "val" in paths else {}),
               **({"codecs": codecs} if codecs else {})},
    )


def _describe_split(store: Store, path: str, roles: dict[str, str], num_proc: int) -> tuple[dict, int]:
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    try:
        dataset = ds.dataset(path, format="parquet", filesystem=store.pyarrow_filesystem())
    except (FileNotFoundError, OSError) as exc:
        raise DatasetNotFoundError(f"no Parquet files at {path!r} in the store {store.url!r} ({exc})") from None
    schema = dataset.schema
    for name, role in roles.items():
        if schema.get_field_index(name) < 0:
            raise ColumnNotFoundError(name, schema.names, role)
    fragments = list(dataset.get_fragments())
    total = sum(f.metadata.num_rows for f in fragments)
    groups = sum(f.metadata.num_row_groups for f in fragments)
    if total == 0:
        raise EmptyDataFrameError(f"the Parquet files at {path!r} hold no rows: there is nothing to train on")
    if total < num_proc or groups < num_proc:
        raise TooFewRowsError(f"the Parquet files at {path!r} hold {total} rows in {groups} row groups, fewer than "
                              f"num_proc={num_proc}: every rank reads whole row groups, so some rank gets none; "
                              "write more files or row groups, or use fit(df), which prepares a copy that has them")
    columns, depths = {}, {}
    for name, role in roles.items():
        columns[name], depths[name] = _column_spec(name, role, schema.field(name).type, path)
    lengths: dict[str, list[list[int]]] = {n: [[] for _ in range(d)] for n, d in depths.items() if d}
    nulls = {n: 0 for n in columns}
    for batch in dataset.to_batches(columns=list(columns)):
        for n in columns:
            arr = batch.column(n)
            nulls[n] += arr.null_count
            for level in lengths.get(n, ()):  # one nesting level after the other: its lengths, its nulls
                if arr.null_count == 0 and len(arr):
                    bounds = pc.min_max(pc.list_value_length(arr))
                    level += [bounds["min"].as_py(), bounds["max"].as_py()]
                arr = arr.flatten()
                nulls[n] += arr.null_count
    bad = {n: k for n, k in nulls.items() if k}
    if bad:
        detail = ", ".join(f"{roles[n]} {n!r}: {k} null values" for n, k in bad.items())
        raise NullValuesError(f"null values in {path!r} ({detail}); the reader takes no nulls: use fit(df) on a "
                              "DataFrame with them dropped or filled (df.na.drop/fill)")
    for n, levels in lengths.items():
        c = columns[n]
        dims = []
        for k, seen in enumerate(levels, start=1):
            lo, hi = (min(seen), max(seen)) if seen else (0, 0)
            if lo != hi and len(levels) == 1:  # token ids, signals: kept ragged, padded per batch by the reader
                columns[n] = ColumnSpec(c.name, c.dtype, (-1,), "ragged", c.spark_type)
                break
            if lo != hi or lo == 0:
                where = f" at nesting level {k}" if k > 1 else ""
                raise InconsistentShapeError(f"{roles[n]} {n!r} in {path!r} holds arrays of lengths {lo} to {hi}"
                                             f"{where}; nested arrays need one fixed, non-zero shape (only 1-D "
                                             "arrays may differ in length)")
            dims.append(int(lo))
        else:
            columns[n] = ColumnSpec(c.name, c.dtype, tuple(dims), c.kind, c.spark_type)
    return columns, total


def _column_spec(name: str, role: str, arrow_type: Any, path: str) -> tuple[ColumnSpec, int]:
    """The stored column's spec (an array's shape still to be measured) and its list nesting depth, or
    ``UnsupportedColumnTypeError`` saying what the reader needs."""
    import numpy as np
    import pyarrow as pa

    from spark_hvd.data.columns import is_list

    if pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type):
        return ColumnSpec(name, "object", (), "binary", "binary"), 0
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return ColumnSpec(name, "object", (), "string", "string"), 0
    depth, value_type = 0, arrow_type
    while is_list(value_type):
        depth, value_type = depth + 1, value_type.value_type
    if (pa.types.is_boolean(value_type) or pa.types.is_signed_integer(value_type)
            or pa.types.is_float32(value_type) or pa.types.is_float64(value_type)):
        dtype = np.dtype(value_type.to_pandas_dtype()).name
        spark = _SPARK_NAMES[dtype]
        for _ in range(depth):
            spark = f"array<{spark}>"
        return ColumnSpec(name, dtype, (), "array" if depth else "scalar", spark), depth
    hint = ""
    if pa.types.is_struct(arrow_type) and {"type", "values"} <= {f.name for f in arrow_type}:
        hint = " (a Spark ML Vector: write it with pyspark.ml.functions.vector_to_array, or use fit(df))"
    elif pa.types.is_decimal(value_type):
        hint = " (a decimal: cast it to double, or use fit(df))"
    raise UnsupportedColumnTypeError(name, f"{arrow_type} in the Parquet files at {path!r}{hint}", role,
                                     needed=_NEEDED + " for fit_on_parquet")


_SPARK_NAMES = {"bool": "boolean", "int8": "tinyint", "int16": "smallint", "int32": "int", "int64": "bigint",
                "float32": "float", "float64": "double"}
