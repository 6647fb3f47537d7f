"""How each column kind becomes part of a batch: Spark's stored sparse Vectors as a CSR matrix (or, for
``transformation_fn``, as the DataFrame's own Vector objects), ragged arrays padded, a ``transformation_fn``'s
DataFrame as arrays. All numpy and Arrow, no Python
loop per row except where each row is its own object (bytes, str, ragged rows, Vectors)."""

from __future__ import annotations

from typing import Any

import numpy as np

from spark_hvd.data.errors import ReaderError

__all__ = ["arrow_kind", "frame_to_batch", "is_list", "pad_ragged", "sparse_to_csr", "sparse_to_vectors",
           "table_to_frame"]

Batch = dict[str, np.ndarray]


def is_list(t: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def arrow_kind(t: Any) -> str:
    """A column's kind from its Arrow type alone (files without spark_hvd metadata)."""
    import pyarrow as pa

    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return "binary"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_struct(t) and {"type", "size", "indices", "values"} <= {f.name for f in t}:
        return "sparse"
    return "array" if is_list(t) else "scalar"


def sparse_to_csr(arr: Any, shape: tuple[int, ...]) -> Any:
    """Spark's stored Vector structs (type 0 sparse: size, indices, values; type 1 dense: values) -> one float32
    ``scipy.sparse.csr_matrix``, with numpy only (no Python loop per row)."""
    import scipy.sparse

    n = len(arr)
    kind = arr.field("type").to_numpy(zero_copy_only=False)
    values = arr.field("values")
    offsets = np.asarray(values.offsets).astype(np.int64)
    offsets -= offsets[0]  # a slice of a row group starts further on
    data = values.flatten().to_numpy(zero_copy_only=False).astype(np.float32)
    lengths = np.diff(offsets)
    # positions within their row: the column index of a dense row's values
    within = np.arange(len(data), dtype=np.int64) - np.repeat(offsets[:-1], lengths)
    indices = within.astype(np.int32)
    sparse_rows = np.repeat(kind == 0, lengths)
    if sparse_rows.any():
        idx = arr.field("indices")
        indices[sparse_rows] = idx.flatten().to_numpy(zero_copy_only=False)
    width = int(shape[0]) if shape and shape[0] != -1 else int(np.max(arr.field("size").fill_null(0)) or 0)
    if n and not width:
        width = int(lengths.max())
    return scipy.sparse.csr_matrix((data, indices, offsets), shape=(n, width))


def sparse_to_vectors(arr: Any) -> np.ndarray:
    """Spark's stored Vector structs -> an object array of ``pyspark.ml.linalg`` ``SparseVector`` / ``DenseVector``,
    the objects the DataFrame holds (float64 values, as Spark keeps them)."""
    from pyspark.ml.linalg import DenseVector, SparseVector

    n = len(arr)
    kind = arr.field("type").to_numpy(zero_copy_only=False)
    size = arr.field("size").fill_null(0).to_numpy(zero_copy_only=False)

    def flat(name: str) -> tuple[np.ndarray, np.ndarray]:
        child = arr.field(name)
        offsets = np.asarray(child.offsets).astype(np.int64)
        return child.flatten().to_numpy(zero_copy_only=False), offsets - offsets[0]  # a slice starts further on

    values, vo = flat("values")
    indices, io = flat("indices")
    out = np.empty(n, dtype=object)
    for r in range(n):
        v = values[vo[r]:vo[r + 1]].astype(np.float64)
        out[r] = SparseVector(int(size[r]), indices[io[r]:io[r + 1]], v) if kind[r] == 0 else DenseVector(v)
    return out


def table_to_frame(table: Any) -> Any:
    """An Arrow table -> the pandas DataFrame ``transformation_fn`` gets: ``table.to_pandas()``, except that a
    column of Spark's stored Vectors holds the Vectors themselves (``sparse_to_vectors``), in training (where
    ``sparse_vectors="sparse"`` stored them so) as in ``transform`` (where Spark hands them over so)."""
    sparse = [c for c in table.column_names if arrow_kind(table.schema.field(c).type) == "sparse"]
    if not sparse:
        if all(_plain(table.column(c)) for c in table.column_names):
            import pandas as pd

            # what to_pandas gives for these columns, at a third of its cost per call (it runs on every batch)
            return pd.DataFrame({c: _owned(table.column(c).to_numpy()) for c in table.column_names}, copy=False)
        return table.to_pandas()
    frame = table.drop_columns(sparse).to_pandas()
    for c in sparse:
        column = table.column(c)
        frame.insert(table.column_names.index(c), c,
                     sparse_to_vectors(column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)))
    return frame


def rows_to_frame(rows: Any) -> Any:
    """The DataFrame ``transformation_fn`` gets from a batch of stored rows: an Arrow table (:func:`table_to_frame`)
    or a dict of the numpy columns of :func:`plain_type` columns (as ``to_numpy`` made them from the table)."""
    if isinstance(rows, dict):
        import pandas as pd

        return pd.DataFrame({c: _owned(v) for c, v in rows.items()}, copy=False)
    return table_to_frame(rows)


def _owned(values: np.ndarray) -> np.ndarray:
    """``values`` if the frame may own it (writable, not a view of a chunk), else a copy: ``to_pandas`` hands over
    writable columns, and a ``transformation_fn`` may change its frame in place."""
    return values if values.flags.writeable and values.base is None else values.copy()


def plain_type(t: Any) -> bool:
    """Numbers, booleans, bytes or str: a column whose ``to_numpy`` gives what ``to_pandas`` does (nulls too:
    NaN in a float column for integers, None in an object column otherwise)."""
    import pyarrow as pa

    return (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t) or pa.types.is_string(t) or pa.types.is_large_string(t))


def _plain(column: Any) -> bool:
    return not column.null_count and plain_type(column.type)


def pad_ragged(rows: np.ndarray, pad_value: float = 0) -> tuple[np.ndarray, np.ndarray]:
    """An object array of 1-D arrays -> ``(padded (n, longest), lengths (n,) int64)``, filled by one scatter."""
    n = len(rows)
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=n)
    dtype = rows[0].dtype if n else np.float32
    width = int(lengths.max()) if n else 0
    out = np.full((n, width), pad_value, dtype=dtype)
    if n and width:
        flat = np.concatenate(list(rows))
        row_of = np.repeat(np.arange(n), lengths)
        col_of = np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        out[row_of, col_of] = flat
    return out, lengths


def frame_to_batch(out: Any, where: str) -> Batch:
    """A ``transformation_fn``'s pandas DataFrame -> a batch: a column of per-row arrays becomes one stacked
    array (its rows must share a shape), ``bytes`` / ``str`` stay object arrays, numbers stay as they are."""
    if out is None or not hasattr(out, "columns"):
        raise ReaderError(f"{where}: transformation_fn must return a pandas DataFrame, got {type(out)}")
    batch = {}
    for c in out.columns:
        values = out[c].to_numpy()
        if values.dtype == object and len(values) and not isinstance(values[0], str | bytes):
            whole = _rows_of_one_array(values)
            if whole is not None:  # e.g. ImageDecoder's list(images): the array itself, no stacking copy
                batch[str(c)] = whole
                continue
            shapes = {np.shape(v) for v in values}
            if len(shapes) > 1:
                found = ", ".join(str(list(sh)) for sh in sorted(shapes)[:4])
                raise ReaderError(f"{where}: transformation_fn returned column {c!r} whose rows differ in "
                                  f"shape ({found}); every row of a column needs one shape (resize or pad "
                                  "them there, or pad per batch in collate_fn)")
            values = np.stack([np.asarray(v) for v in values])
        batch[str(c)] = values
    return batch


def _rows_of_one_array(values: np.ndarray) -> np.ndarray | None:
    """The C-contiguous array whose rows ``values`` holds, one each in order (``list(array)``), else None."""
    first = values[0]
    base = first.base if isinstance(first, np.ndarray) else None
    if (not isinstance(base, np.ndarray) or base.shape != (len(values), *first.shape) or base.dtype != first.dtype
            or not base.flags.c_contiguous):
        return None
    start, step = base.__array_interface__["data"][0], base.strides[0] if base.ndim else 0
    for i, v in enumerate(values):
        if (not isinstance(v, np.ndarray) or v.base is not base or v.shape != first.shape
                or v.__array_interface__["data"][0] != start + i * step):
            return None
    return base
