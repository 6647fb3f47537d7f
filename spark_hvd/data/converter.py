"""petastorm's converter shape over spark_hvd's prepared data: ``make_converter(df, store)``, then a torch
``DataLoader``-like iterable or a ``tf.data.Dataset`` of this process's shard, in any training function.

Code written for petastorm's ``make_spark_converter`` moves over with its calls unchanged::

    from spark_hvd.data import make_converter

    with make_converter(df, store) as converter:               # petastorm: make_spark_converter(df)
        def train():
            with converter.make_torch_dataloader(batch_size=64, num_epochs=1) as loader:
                for batch in loader:                           # a dict of tensors by column
                    ...
        spark_hvd.runner.run(train, num_proc=2)                # or TorchDistributor(...).run(train), a notebook
    # the prepared files are deleted here (or call converter.delete())

The DataFrame is prepared once with :func:`~spark_hvd.data.prepare.prepare_data` (every column; Vectors become
float32 arrays) into the store's data cache: a converter of the same DataFrame, or an estimator's ``fit`` on the
same data and settings, finds it there instead of writing again. Each process reads its own shard
(``cur_shard`` of ``shard_count``; by default this process's rank and size: ``spark_hvd``'s own inside ``run()``
and ``spark-hvd-run``, torchrun's ``RANK``/``WORLD_SIZE`` under TorchDistributor, else 0 of 1), shuffled each
epoch, through :class:`~spark_hvd.data.reader.BatchReader`. ``num_epochs=None`` repeats for ever, as petastorm's.
``dtype="float32"`` (petastorm's default) hands double columns over as float32; ``None`` keeps them as stored.

The converter pickles (store and dataset metadata), so it travels into the training function.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from spark_hvd.data.errors import InvalidParamError

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import DataFrame

    from spark_hvd.data.metadata import DatasetInfo
    from spark_hvd.data.reader import BatchReader
    from spark_hvd.store import Store

logger = logging.getLogger(__name__)

__all__ = ["Converter", "make_converter", "default_shard"]


def make_converter(df: DataFrame, store: Store | str, *, num_proc: int | None = None,
                   partitions_per_process: int = 4, compression: str = "snappy",
                   row_group_bytes: int | None = None, dtype: str | None = "float32") -> Converter:
    """Prepare ``df`` (every column) in ``store``'s data cache and return a :class:`Converter` of it.

    Args:
        df: the DataFrame; its columns as ``prepare_data`` takes them (numbers, Vectors, arrays, binary, string).
        store: a :class:`~spark_hvd.store.Store` or its URL; the ranks must reach it.
        num_proc: the most processes expected to read it (files are written for that many); default: the
            session's default parallelism.
        partitions_per_process, compression, row_group_bytes: as in ``prepare_data``.
        dtype: ``"float32"`` (default, petastorm's): float64 columns are handed over as float32; ``None``: as stored.
    """
    from spark_hvd.data.prepare import dataset_key, prepare_data
    from spark_hvd.store import Store

    if isinstance(store, str):
        store = Store.create(store)
    if dtype not in (None, "float32", "float64"):
        raise InvalidParamError(f"dtype must be 'float32', 'float64' or None, got {dtype!r}")
    if num_proc is None:
        num_proc = max(1, int(df.sparkSession.sparkContext.defaultParallelism)) if _classic(df) else 1
    columns = list(df.columns)
    settings = {"num_proc": num_proc, "partitions_per_process": partitions_per_process, "compression": compression,
                "row_group_bytes": row_group_bytes}
    key = dataset_key(df, columns, [], **settings)
    existed = store.is_committed(store.data_path(key))
    info = prepare_data(df, store, columns, [], **settings)
    return Converter(store, info, owned=not existed, dtype=dtype)


def _classic(df: Any) -> bool:
    try:
        return df.sparkSession.sparkContext is not None
    except Exception:  # Spark Connect has no SparkContext
        return False


def default_shard() -> tuple[int, int]:
    """``(rank, size)`` of this process: spark_hvd's (inside ``run()`` / ``spark-hvd-run``), else torchrun's
    ``RANK``/``WORLD_SIZE`` (TorchDistributor, torchrun), else ``(0, 1)``."""
    from spark_hvd.core.jobenv import RANK, SIZE

    for rank_var, size_var in ((RANK, SIZE), ("RANK", "WORLD_SIZE")):
        if os.environ.get(rank_var) is not None and os.environ.get(size_var) is not None:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return 0, 1


class Converter:
    """A DataFrame prepared in the store, handed to training code as loaders of a process's shard.

    Attributes:
        store, info: where the data is and its :class:`~spark_hvd.data.metadata.DatasetInfo`.
        dataset_size: rows (petastorm's name); ``len(converter)`` too.
        owned: whether this converter wrote the files (``delete`` removes only those: a dataset found in the
            cache belongs to whoever prepared it).
    """

    def __init__(self, store: Store, info: DatasetInfo, owned: bool = True, dtype: str | None = "float32") -> None:
        self.store, self.info, self.owned, self.dtype = store, info, owned, dtype
        self.dataset_size = int(info.train_rows)

    def __len__(self) -> int:
        return self.dataset_size

    def __repr__(self) -> str:
        return f"Converter({self.info.key!r} in {self.store!r}, {self.dataset_size} rows)"

    @property
    def file_urls(self) -> list[str]:
        """The Parquet files (store URLs), as petastorm's ``file_urls``."""
        path = self.info.train_path(self.store)
        return sorted(self.store.spark_url(f"{path}/{n}") for n in self.store.listdir(path) if n.endswith(".parquet"))

    def reader(self, batch_size: int = 32, cur_shard: int | None = None, shard_count: int | None = None,
               shuffle: bool = True, seed: int = 0, columns: Sequence[str] | None = None,
               **reader_kwargs: Any) -> BatchReader:
        """The :class:`~spark_hvd.data.reader.BatchReader` of one shard (default: this process's,
        :func:`default_shard`); ``reader_kwargs`` go to it (``drop_last``, ``transformation_fn``, ...)."""
        from spark_hvd.data.reader import BatchReader

        rank, size = default_shard()
        if (cur_shard is None) != (shard_count is None):
            raise InvalidParamError(f"give both cur_shard and shard_count or neither, got cur_shard={cur_shard} "
                                    f"shard_count={shard_count}")
        if cur_shard is not None:
            rank, size = int(cur_shard), int(shard_count)
        return BatchReader.from_dataset(self.store, self.info, "train", columns=columns, rank=rank, size=size,
                                        batch_size=batch_size, shuffle=shuffle, seed=seed, **reader_kwargs)

    def batches(self, reader: BatchReader, num_epochs: int | None) -> Iterator[dict[str, np.ndarray]]:
        """The reader's batches for ``num_epochs`` epochs (``None``: for ever), floats cast to ``dtype``."""
        epochs = itertools.count() if num_epochs is None else range(int(num_epochs))
        cast = np.dtype(self.dtype) if self.dtype else None
        for epoch in epochs:
            for batch in reader.epoch(epoch):
                if cast is not None:
                    batch = {k: v.astype(cast) if isinstance(v, np.ndarray) and v.dtype.kind == "f" and
                             v.dtype != cast else v for k, v in batch.items()}
                yield batch

    @contextlib.contextmanager
    def make_torch_dataloader(self, batch_size: int = 32, num_epochs: int | None = 1, cur_shard: int | None = None,
                              shard_count: int | None = None, shuffle: bool = True, seed: int = 0,
                              columns: Sequence[str] | None = None, **reader_kwargs: Any) -> Iterator[TorchLoader]:
        """A context manager giving an iterable of batches, each a dict of torch tensors by column, of this
        process's shard for ``num_epochs`` epochs (``None``: for ever); ``len()`` is its number of batches when
        finite. The reader's threads stop when the block ends."""
        reader = self.reader(batch_size, cur_shard, shard_count, shuffle, seed, columns, **reader_kwargs)
        try:
            yield TorchLoader(self, reader, num_epochs)
        finally:
            reader.close()

    @contextlib.contextmanager
    def make_tf_dataset(self, batch_size: int = 32, num_epochs: int | None = 1, cur_shard: int | None = None,
                        shard_count: int | None = None, shuffle: bool = True, seed: int = 0,
                        columns: Sequence[str] | None = None, prefetch: int | None = None,
                        **reader_kwargs: Any) -> Iterator[Any]:
        """A context manager giving a ``tf.data.Dataset`` of this process's shard: elements are dicts of tensors by
        column, ``(batch, *shape)``; ``prefetch`` batches prefetched by tf.data (default: AUTOTUNE)."""
        import tensorflow as tf

        reader = self.reader(batch_size, cur_shard, shard_count, shuffle, seed, columns, **reader_kwargs)
        cols = reader.columns
        specs = {}
        for c in cols:
            spec = self.info.columns[c]
            if not spec.numeric:
                raise InvalidParamError(f"make_tf_dataset takes numeric columns; {c!r} is {spec.kind} "
                                        f"({spec.spark_type}): leave it out with columns=")
            dtype = np.dtype(spec.dtype)
            if self.dtype and dtype.kind == "f":
                dtype = np.dtype(self.dtype)
            specs[c] = tf.TensorSpec((None, *spec.shape), tf.as_dtype(dtype))
        try:
            dataset = tf.data.Dataset.from_generator(lambda: self.batches(reader, num_epochs), output_signature=specs)
            yield dataset.prefetch(tf.data.AUTOTUNE if prefetch is None else prefetch)
        finally:
            reader.close()

    def delete(self) -> None:
        """Delete the prepared files, where this converter wrote them (petastorm's ``delete``)."""
        if self.owned and self.store.exists(self.store.data_path(self.info.key)):
            self.store.delete(self.store.data_path(self.info.key))
            logger.info("deleted the converter's dataset %s from %r", self.info.key, self.store)
        self.owned = False

    def __enter__(self) -> Converter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.delete()


class TorchLoader:
    """Batches of one shard as dicts of torch tensors (what ``make_torch_dataloader`` yields)."""

    def __init__(self, converter: Converter, reader: BatchReader, num_epochs: int | None) -> None:
        self.converter, self.reader, self.num_epochs = converter, reader, num_epochs

    def __len__(self) -> int:
        if self.num_epochs is None:
            raise TypeError("a loader with num_epochs=None has no length")
        return len(self.reader) * int(self.num_epochs)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        import torch

        for batch in self.converter.batches(self.reader, self.num_epochs):
            yield {k: torch.from_numpy(_writable(v)) if isinstance(v, np.ndarray) and v.dtype != object else v
                   for k, v in batch.items()}


def _writable(value: np.ndarray) -> np.ndarray:
    """Arrays sharing Arrow's read-only buffers are copied, so the tensors may be written in place."""
    return value if value.flags.writeable and value.flags.c_contiguous else np.array(value, order="C")
