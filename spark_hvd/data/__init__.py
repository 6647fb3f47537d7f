"""Data for training: driver-side preparation of a DataFrame into the store, worker-side sharded batch reading.

- :func:`prepare_data` (driver): DataFrame -> Parquet under ``store.data_path(key)`` + ``_metadata.json``, cached.
- :class:`BatchReader` (worker): rank r of n reads its shard as numpy batches; ``BatchReader.from_dataset(store,
  info)``.
- :func:`make_converter` (driver): petastorm's ``make_spark_converter`` shape: ``with make_converter(df, store) as
  c:`` then ``c.make_torch_dataloader(...)`` / ``c.make_tf_dataset(...)`` in any training function.
- ``spark_hvd.data.torch_loader.TorchBatchLoader`` and ``spark_hvd.data.keras_loader.KerasBatchDataset``: the
  framework wrappers (import them from their modules; they import torch / keras).

pyspark and pyarrow are imported where they are used; importing this package is cheap.
"""

from __future__ import annotations

from typing import Any

from spark_hvd.data import errors
from spark_hvd.data.metadata import ColumnSpec, DatasetInfo

__all__ = ["BatchReader", "ColumnSpec", "DatasetInfo", "errors", "make_converter", "prepare_data"]


def __getattr__(name: str) -> Any:
    if name == "prepare_data":
        from spark_hvd.data.prepare import prepare_data

        return prepare_data
    if name == "BatchReader":
        from spark_hvd.data.reader import BatchReader

        return BatchReader
    if name == "make_converter":
        from spark_hvd.data.converter import make_converter

        return make_converter
    raise AttributeError(f"module 'spark_hvd.data' has no attribute {name!r}")
