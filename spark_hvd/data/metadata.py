"""Metadata of a prepared dataset, saved as ``data/<key>/_metadata.json`` beside the Parquet files."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spark_hvd.data.errors import DatasetNotFoundError

if TYPE_CHECKING:  # pragma: no cover
    from spark_hvd.store import Store

FORMAT_VERSION = 1

#: Column kinds whose rows are numbers the reader hands over as one numeric array of ``(rows, *shape)``.
NUMERIC_KINDS = frozenset({"scalar", "vector", "array"})
#: Every kind the data layer stores (see :class:`ColumnSpec`).
KINDS = NUMERIC_KINDS | {"binary", "string", "ragged", "sparse"}


def model_input_dtype(stored: str | None) -> Any:
    """The numpy dtype a model gets for a column stored as ``stored``: floats and bools as float32 (the
    frameworks' default parameter dtype), integers as int64 (class indices, embedding ids). Used by training and
    by ``transform`` alike, so both feed the model the same arrays."""
    if stored is None:
        return None
    import numpy as np

    dt = np.dtype(stored)
    return np.int64 if np.issubdtype(dt, np.integer) else np.float32


def column_roles(feature_cols: Sequence[str], label_cols: Sequence[str],
                 sample_weight_col: str | None) -> dict[str, str]:
    """Each used column's role, as errors name it ("feature column", "label column", "sample weight column"),
    in that order; a column used twice keeps its first role."""
    roles: dict[str, str] = {}
    for c in feature_cols:
        roles.setdefault(c, "feature column")
    for c in label_cols:
        roles.setdefault(c, "label column")
    if sample_weight_col:
        roles.setdefault(sample_weight_col, "sample weight column")
    return roles


@dataclass(frozen=True)
class ColumnSpec:
    """One stored column.

    Attributes:
        name: the column name (as in the DataFrame and the Parquet files).
        dtype: numpy dtype name of the values (``float32`` for vectors, ``bool``, ``int64`` ...; ``object`` for
            binary and string columns, whose rows are Python ``bytes`` / ``str``).
        shape: shape of one row's value: ``()`` for a scalar, a binary or a string; ``(n,)`` for a vector or an
            array of length n; ``(d1, d2, ...)`` for nested fixed-shape arrays (``array<array<float>>``); ``(-1,)``
            for a ragged array; ``(n,)`` for a sparse vector of size n.
        kind: ``"scalar"``; ``"vector"`` (a pyspark.ml Vector, stored as a dense float32 array); ``"array"`` (one
            fixed shape, nested or not); ``"ragged"`` (1-D numeric arrays of varying length, stored as they are);
            ``"sparse"`` (a Vector stored as Spark writes it: size, indices, values); ``"binary"``; ``"string"``.
        spark_type: the Spark SQL type it came from (``simpleString``).
    """

    name: str
    dtype: str
    shape: tuple[int, ...] = ()
    kind: str = "scalar"
    spark_type: str = ""

    @property
    def numeric(self) -> bool:
        """Whether rows are numbers handed over as one ``(rows, *shape)`` array (scalar, vector, array)."""
        return self.kind in NUMERIC_KINDS

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ColumnSpec:
        return cls(
            d["name"],
            d["dtype"],
            tuple(int(x) for x in d.get("shape", ())),
            d.get("kind", "scalar"),
            d.get("spark_type", ""),
        )


@dataclass(frozen=True)
class DatasetInfo:
    """What :func:`spark_hvd.data.prepare_data` wrote: where, which columns, how many rows.

    Attributes:
        key: the dataset key (``data/<key>/`` in the store).
        columns: the stored columns by name, in storage order.
        feature_cols, label_cols: the columns as given to ``prepare_data``.
        sample_weight_col: the weight column, or ``None``.
        train_rows, val_rows: row counts of the two splits (``val_rows`` is 0 without validation).
        num_partitions: how many Parquet files each split was written as.
        validation: the ``validation`` setting (fraction, column name or ``None``).
        seed: the split seed.
        fingerprint: the hash of DataFrame plan and settings the key was made from.
    """

    key: str
    columns: dict[str, ColumnSpec]
    feature_cols: list[str]
    label_cols: list[str]
    sample_weight_col: str | None = None
    train_rows: int = 0
    val_rows: int = 0
    num_partitions: int = 0
    validation: float | str | None = None
    seed: int = 0
    fingerprint: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def has_validation(self) -> bool:
        """Whether a validation split was written."""
        return self.val_rows > 0

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Per column, the shape of one row's value."""
        return {n: c.shape for n, c in self.columns.items()}

    def dtypes(self) -> dict[str, str]:
        """Per column, the numpy dtype name."""
        return {n: c.dtype for n, c in self.columns.items()}

    def train_path(self, store: Store) -> str:
        """Store path of the training files (the user's own directory for a dataset described in place by
        :func:`spark_hvd.data.parquet.describe_parquet`)."""
        return self.extra.get("train_path") or store.train_data_path(self.key)

    def val_path(self, store: Store) -> str:
        """Store path of the validation files (the user's own directory for a dataset described in place)."""
        return self.extra.get("val_path") or store.val_data_path(self.key)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (the content of ``_metadata.json``)."""
        return {
            "format_version": FORMAT_VERSION,
            "key": self.key,
            "columns": [c.to_json() for c in self.columns.values()],
            "feature_cols": list(self.feature_cols),
            "label_cols": list(self.label_cols),
            "sample_weight_col": self.sample_weight_col,
            "train_rows": int(self.train_rows),
            "val_rows": int(self.val_rows),
            "num_partitions": int(self.num_partitions),
            "validation": self.validation,
            "seed": int(self.seed),
            "fingerprint": self.fingerprint,
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DatasetInfo:
        """The inverse of :meth:`to_json`."""
        cols = [ColumnSpec.from_json(c) for c in d["columns"]]
        return cls(
            key=d["key"],
            columns={c.name: c for c in cols},
            feature_cols=list(d["feature_cols"]),
            label_cols=list(d["label_cols"]),
            sample_weight_col=d.get("sample_weight_col"),
            train_rows=int(d.get("train_rows", 0)),
            val_rows=int(d.get("val_rows", 0)),
            num_partitions=int(d.get("num_partitions", 0)),
            validation=d.get("validation"),
            seed=int(d.get("seed", 0)),
            fingerprint=d.get("fingerprint", ""),
            extra=dict(d.get("extra", {})),
        )

    def dumps(self) -> str:
        """The JSON text."""
        return json.dumps(self.to_json(), indent=2, sort_keys=True)

    @classmethod
    def load(cls, store: Store, key: str) -> DatasetInfo:
        """The metadata of the committed dataset ``key`` in ``store``.

        Raises:
            DatasetNotFoundError: no committed dataset with that key.
        """
        if not store.is_committed(store.data_path(key)):
            raise DatasetNotFoundError(f"no prepared dataset {key!r} in {store!r}")
        return cls.from_json(store.read_json(store.metadata_path(key)))
