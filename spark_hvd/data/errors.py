"""Exception types of the data layer. Every one is a ``ValueError`` naming the column or parameter at fault."""

from __future__ import annotations

from collections.abc import Sequence

from spark_hvd.errors import SparkHvdError


class DataError(SparkHvdError, ValueError):
    """Base class of the data layer's errors."""


class ColumnNotFoundError(DataError):
    """A column named in the settings is not in the DataFrame (the message suggests the closest names)."""

    def __init__(self, column: str, available: Sequence[str], role: str = "column") -> None:
        import difflib

        close = difflib.get_close_matches(column, list(available), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        super().__init__(f"{role} {column!r} is not in the DataFrame{hint} (columns: {', '.join(map(str, available))})")
        self.column = column
        self.suggestions = close


class UnsupportedColumnTypeError(DataError):
    """A column's Spark type cannot be turned into a fixed-shape numeric array."""

    def __init__(self, column: str, spark_type: str, role: str = "column", needed: str | None = None) -> None:
        super().__init__(
            f"{role} {column!r} has type {spark_type}, which is not supported: use "
            + (needed or "a numeric or boolean scalar, a pyspark.ml.linalg.Vector, or an array of numbers of one "
               "fixed length")
        )
        self.column = column
        self.spark_type = spark_type


class NullValuesError(DataError):
    """A used column holds nulls (or an array column holds null elements)."""


class InconsistentShapeError(DataError):
    """An array or vector column holds values of different lengths."""


class EmptyDataFrameError(DataError):
    """The DataFrame (or one side of the train/validation split) has no rows."""


class TooFewRowsError(DataError):
    """Fewer rows than training processes: some rank would get no data."""


class ValidationParamError(DataError):
    """``validation`` is neither a fraction in (0, 1) nor the name of a boolean or numeric column."""


class InvalidParamError(DataError):
    """Another preparation or reader parameter is out of range."""


class DatasetNotFoundError(DataError):
    """No committed dataset with this key in the store."""


class ReaderError(DataError):
    """The batch reader failed (the message names the rank and the path)."""


class ReaderTimeoutError(ReaderError, TimeoutError):
    """The read-ahead thread produced no batch within the timeout."""
