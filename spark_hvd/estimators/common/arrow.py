"""Arrow <-> numpy for ``transform``: feature columns in, model outputs out (one reshape of the flat values)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["feature_to_numpy", "output_to_arrow", "output_spark_type"]


def _flatten_lists(arr: Any, name: str) -> tuple[Any, int]:
    """Strip list levels off an Arrow array; returns (flat values array, depth). Nulls and ragged rows are errors."""
    import pyarrow as pa
    import pyarrow.compute as pc

    depth = 0
    while pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type) or pa.types.is_fixed_size_list(arr.type):
        if arr.null_count:
            raise ValueError(f"feature column {name!r} has null rows; drop or fill them before transform")
        if len(arr) and not pa.types.is_fixed_size_list(arr.type):
            lengths = pc.list_value_length(arr)
            bounds = pc.min_max(lengths)
            if bounds["min"].as_py() != bounds["max"].as_py():
                raise ValueError(f"feature column {name!r} has arrays of different lengths "
                                 f"({bounds['min'].as_py()}..{bounds['max'].as_py()}); the model needs a fixed shape")
        arr = arr.flatten()
        depth += 1
    return arr, depth


def feature_to_numpy(column: Any, name: str, dtype: Any = None, shape: list[int] | tuple | None = None) -> np.ndarray:
    """One Arrow feature column (scalar, list or nested list; Vectors arrive as ``list<float>``) -> numpy.

    The result has one row per input row: ``(n,)`` for a scalar column, ``(n, k)`` for a flat array, ``(n, *shape)``
    where ``shape`` is given (the shape recorded by the data layer, or the user's ``input_shapes``). ``dtype``
    defaults to float32 for floating and bool columns and int64 for integer columns, as the training reader gives them.
    """
    import pyarrow as pa

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    n = len(column)
    if column.null_count:
        raise ValueError(f"feature column {name!r} has null rows; drop or fill them before transform")
    flat, depth = _flatten_lists(column, name)
    values = flat.to_numpy(zero_copy_only=False)
    if dtype is None:
        dtype = np.int64 if np.issubdtype(values.dtype, np.integer) else np.float32
    values = values.astype(dtype, copy=False)
    if shape is not None:
        per_row = int(np.prod(shape, dtype=np.int64))
        if values.size != n * per_row:
            raise ValueError(f"feature column {name!r} has {values.size // max(n, 1)} values per row; the model "
                             f"was trained on shape {list(shape)} ({per_row} values)")
        return values.reshape((n, *shape))
    if depth == 0:
        return values
    return values.reshape(n, -1) if n else values.reshape(0, 0)


def output_to_arrow(out: np.ndarray, n: int) -> Any:
    """A model output for ``n`` rows -> Arrow: one value per row -> float64, several -> ``list<float>``."""
    import pyarrow as pa

    out = np.asarray(out)
    if out.shape[:1] != (n,):
        raise ValueError(f"model returned {out.shape[:1]} rows for a batch of {n}")
    per_row = int(np.prod(out.shape[1:], dtype=np.int64))
    if per_row == 1:
        return pa.array(out.reshape(n).astype(np.float64, copy=False), type=pa.float64())
    flat = out.reshape(-1).astype(np.float32, copy=False)
    offsets = np.arange(0, n * per_row + 1, per_row, dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=pa.float32()))


def output_spark_type(per_row_shape: list[int] | tuple) -> Any:
    from pyspark.sql.types import ArrayType, DoubleType, FloatType

    return DoubleType() if int(np.prod(per_row_shape, dtype=np.int64)) == 1 else ArrayType(FloatType())
