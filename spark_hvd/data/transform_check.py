"""Driver side: run ``transformation_fn`` / ``collate_fn`` on the first rows of a prepared dataset before any
training task starts, so that a decoder returning the wrong columns or shapes fails at once, naming the column."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from spark_hvd.data.errors import DataError, ReaderError

if TYPE_CHECKING:  # pragma: no cover
    from spark_hvd.data.metadata import DatasetInfo
    from spark_hvd.store import Store

__all__ = ["TransformationFnError", "check_batch_functions"]


class TransformationFnError(DataError):
    """``transformation_fn`` or ``collate_fn`` returned columns the model cannot take (missing, ragged, not
    numbers)."""


def check_batch_functions(store: Store, info: DatasetInfo, columns: Sequence[str], model_cols: Sequence[str],
                          transformation_fn: Callable | None, collate_fn: Callable | None,
                          rows: int = 4) -> dict[str, tuple[int, ...]]:
    """Read ``rows`` rows of the training split as a rank would (same reader, same functions) and check that every
    column of ``model_cols`` comes out as numbers of one shape per row. Returns each one's per-row shape.

    Raises:
        TransformationFnError: naming the function, the column and what was wrong.
    """
    from spark_hvd.data.reader import BatchReader

    if transformation_fn is None and collate_fn is None:
        return {}
    what = " and ".join(n for n, f in (("transformation_fn", transformation_fn), ("collate_fn", collate_fn)) if f)
    reader = BatchReader.from_dataset(store, info, "train", columns=list(columns), batch_size=rows, shuffle=False,
                                      prefetch=0, read_ahead_pieces=1, transformation_fn=transformation_fn,
                                      collate_fn=collate_fn)
    gen = reader.epoch(0)
    try:
        batch = next(iter(gen))
    except ReaderError as exc:
        raise TransformationFnError(f"{what}, tried on the driver on the first {rows} rows: {exc}") from exc
    except DataError:
        raise
    except Exception as exc:
        raise TransformationFnError(f"{what} failed on the driver on the first {rows} rows: "
                                    f"{type(exc).__name__}: {exc}") from exc
    finally:
        close: Any = getattr(gen, "close", None)
        if close is not None:
            close()
    shapes = {}
    for col in model_cols:
        if col not in batch:
            raise TransformationFnError(f"{what} returned no column {col!r} (it returned {sorted(batch)}); the model "
                                        f"takes {list(model_cols)}: keep or create every one")
        value = batch[col]
        if not hasattr(value, "shape") or not isinstance(value, np.ndarray):
            continue  # a sparse matrix or a framework tensor: the framework's loop decides
        if value.dtype == object:
            kind = type(value[0]).__name__ if len(value) else "object"
            raise TransformationFnError(f"{what} returned column {col!r} as {kind} values, not numbers; decode it "
                                        "into arrays of one shape per row (e.g. spark_hvd.data.decode.ImageDecoder) "
                                        "or pad it in collate_fn")
        if len(value) != len(batch[model_cols[0]]):
            raise TransformationFnError(f"{what} returned {len(value)} rows of column {col!r} for "
                                        f"{len(batch[model_cols[0]])} rows of {model_cols[0]!r}")
        shapes[col] = tuple(value.shape[1:])
    return shapes
