"""Keras 3 on top of :class:`~spark_hvd.data.reader.BatchReader`: a ``keras.utils.PyDataset`` for ``model.fit``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import keras
import numpy as np

from spark_hvd.data.reader import BatchReader


class KerasBatchDataset(keras.utils.PyDataset):
    """Batches of a :class:`BatchReader` as ``(x, y)`` or ``(x, y, sample_weight)`` for ``model.fit``.

    ``x`` is the array of the one feature column, or a list of arrays in ``feature_cols`` order (same for ``y``).
    ``len()`` is the reader's ``steps_per_epoch`` (equal on every rank). Keras asks for the batches of an epoch
    in order (``workers=1``, the default); each epoch reads the next epoch of the reader, so shuffles differ from
    epoch to epoch. Read-ahead happens on the reader's own thread.
    """

    def __init__(
        self,
        reader: BatchReader,
        feature_cols: Sequence[str],
        label_cols: Sequence[str] | None = None,
        sample_weight_col: str | None = None,
        first_epoch: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.reader = reader
        self.feature_cols = list(feature_cols)
        self.label_cols = list(label_cols or [])
        self.sample_weight_col = sample_weight_col
        self._epoch = int(first_epoch)
        self._it: Iterator[dict[str, np.ndarray]] | None = None
        self._next_index = 0

    def __len__(self) -> int:
        return len(self.reader)

    @property
    def num_batches(self) -> int:
        return len(self.reader)

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        if index >= len(self):
            raise IndexError(f"batch {index} of an epoch of {len(self)} batches")
        if self._it is None or index != self._next_index:
            if index != 0:
                raise IndexError(f"batches are read in order: asked for {index}, next is {self._next_index}")
            if self._it is not None and hasattr(self._it, "close"):
                self._it.close()  # a restart of the same epoch (Keras peeks at the first batches)
            self._it = iter(self.reader.epoch(self._epoch))
        batch = next(self._it)
        self._next_index = index + 1
        if self._next_index == len(self):
            self._finish_epoch()
        x = _pick(batch, self.feature_cols)
        if not self.label_cols:
            return (x,)
        y = _pick(batch, self.label_cols)
        if self.sample_weight_col:
            return x, y, batch[self.sample_weight_col]
        return x, y

    def on_epoch_end(self) -> None:
        if self._it is not None:
            self._finish_epoch()

    def _finish_epoch(self) -> None:
        it, self._it = self._it, None
        if it is not None and hasattr(it, "close"):
            it.close()
        self._next_index = 0
        self._epoch += 1


def _pick(batch: dict[str, np.ndarray], cols: list[str]) -> Any:
    return batch[cols[0]] if len(cols) == 1 else [batch[c] for c in cols]
