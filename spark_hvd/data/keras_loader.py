"""Keras 3 on top of :class:`~spark_hvd.data.reader.BatchReader`: a ``keras.utils.PyDataset`` for ``model.fit``."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import numpy as np

from spark_hvd.data.reader import BatchReader


class KerasBatchDataset(keras.utils.PyDataset):
    """Batches of a :class:`BatchReader` as ``(x, y)`` or ``(x, y, sample_weight)`` for ``model.fit``.

    ``x`` is the array of the one feature column, or a list of arrays in ``feature_cols`` order (same for ``y``).
    ``len()`` is the reader's ``steps_per_epoch``, equal on every rank.

    The reader is a stream, already shuffled: whatever index Keras asks for (``fit`` visits indices in a random
    order), the next batch of the stream is returned. An epoch of the reader ends after ``len()`` batches, and the
    next one starts (so shuffles differ from epoch to epoch); an ``on_epoch_end`` in the middle of an epoch (Keras
    peeks at the first batches before training) restarts that epoch. Read-ahead happens on the reader's thread.

    ``skip``: the first epoch (``first_epoch``) starts after its first ``skip`` batches (read and dropped: a resume
    from a checkpoint inside that epoch) and ends ``skip`` batches early; ask ``fit`` for ``len() - skip`` steps.
    """

    def __init__(
        self,
        reader: BatchReader,
        feature_cols: Sequence[str],
        label_cols: Sequence[str] | None = None,
        sample_weight_col: str | None = None,
        first_epoch: int = 0,
        skip: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.reader = reader
        self.feature_cols = list(feature_cols)
        self.label_cols = list(label_cols or [])
        self.sample_weight_col = sample_weight_col
        self.epoch = int(first_epoch)
        self._skip = (int(first_epoch), int(skip))
        self._it: Iterator[dict[str, np.ndarray]] | None = None
        self._count = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.reader)

    @property
    def num_batches(self) -> int:
        return len(self.reader)

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} of an epoch of {len(self)} batches")
        with self._lock:
            if self._it is None:
                self._it = iter(self.reader.epoch(self.epoch))
                if self.epoch == self._skip[0]:
                    for _ in range(self._skip[1]):
                        next(self._it)
                    self._count = self._skip[1]
            batch = next(self._it)
            self._count += 1
            if self._count == len(self):
                self._close()
                self.epoch += 1
        x = _pick(batch, self.feature_cols)
        if not self.label_cols:
            return (x,)
        y = _pick(batch, self.label_cols)
        if self.sample_weight_col:
            return x, y, batch[self.sample_weight_col]
        return x, y

    def on_epoch_end(self) -> None:
        """Restart the current epoch if it was only partly read (a finished epoch has already moved on)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        it, self._it, self._count = self._it, None, 0
        if it is not None and hasattr(it, "close"):
            it.close()


def _pick(batch: dict[str, np.ndarray], cols: list[str]) -> Any:
    # A tuple, not a list: Keras's TensorFlow adapter accepts no lists inside a batch's structure.
    return batch[cols[0]] if len(cols) == 1 else tuple(batch[c] for c in cols)
