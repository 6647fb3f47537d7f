"""What the reader needs to know of a petastorm dataset's columns: per encoded column, its codec, dtype and shape.

:func:`dataset_codecs` reads the dataset's Unischema (``spark_hvd.data.unischema``) and returns, for each column a
codec stores as bytes (``NdarrayCodec``, ``CompressedNdarrayCodec``, ``CompressedImageCodec``), a JSON-able
``{"kind", "dtype", "shape", "format"}``; ``BatchReader`` decodes those columns into ``(rows, *shape)`` arrays
(``spark_hvd.data.petastorm_codecs``) and ``describe_parquet`` (``fit_on_parquet``) describes them as fixed-shape
arrays. A field whose shape has ``None`` (any length) takes the shape of the first stored row; rows of another
shape then fail in the reader, naming the column. ``ScalarCodec`` columns are stored natively and need nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from spark_hvd.data.errors import UnsupportedColumnTypeError
from spark_hvd.data.metadata import ColumnSpec

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow.fs

__all__ = ["codec_column_spec", "dataset_codecs"]


def dataset_codecs(path: str, filesystem: pyarrow.fs.FileSystem | None = None,
                   columns: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    """Per encoded column of ``columns`` (default: all) of the petastorm dataset at ``path``, what decodes it;
    ``{}`` for a plain Parquet directory (no Unischema in a ``_common_metadata``).

    Raises:
        spark_hvd.data.unischema.UnischemaError: an unreadable Unischema.
        UnsupportedColumnTypeError: an object-dtype (pickled) ndarray field.
    """
    from spark_hvd.data.unischema import read_unischema

    schema = read_unischema(path, filesystem)
    if schema is None:
        return {}
    wanted = set(columns) if columns is not None else None
    out: dict[str, dict[str, Any]] = {}
    for name, f in schema.fields.items():
        if f.codec is None or f.codec.kind == "scalar" or (wanted is not None and name not in wanted):
            continue
        if f.numpy_dtype.hasobject or f.numpy_dtype.kind in "USV":
            raise UnsupportedColumnTypeError(name, f"petastorm {f.numpy_dtype} ndarray in {path!r}",
                                             needed="a petastorm field of numbers (strings and objects are pickled)")
        codec = f.codec.to_json()
        codec.update(dtype=f.numpy_dtype.name, shape=list(f.shape))
        out[name] = codec
    unknown = [n for n, c in out.items() if None in c["shape"]]
    if unknown:
        _first_row_shapes(path, filesystem, {n: out[n] for n in unknown})
    return out


def _first_row_shapes(path: str, filesystem: Any, codecs: dict[str, dict[str, Any]]) -> None:
    """Fill the ``None`` dimensions of ``codecs``' shapes from the first stored row."""
    import pyarrow.dataset as ds

    from spark_hvd.data.petastorm_codecs import decode_value

    dataset = ds.dataset(path, format="parquet", filesystem=filesystem)
    first = dataset.head(1, columns=list(codecs))
    for name, codec in codecs.items():
        value = first.column(name)[0].as_py() if first.num_rows else None
        if value is None:
            continue
        shape = decode_value(codec, value, name).shape
        codec["shape"] = [int(s) for s in shape]


def codec_column_spec(name: str, codec: dict[str, Any]) -> ColumnSpec:
    """The :class:`ColumnSpec` of an encoded column as the reader hands it over: a fixed-shape array."""
    shape = tuple(int(s) if s is not None else -1 for s in codec["shape"])
    return ColumnSpec(name, codec["dtype"], shape, "array" if shape else "scalar", "binary")
