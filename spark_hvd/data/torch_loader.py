"""torch on top of :class:`~spark_hvd.data.reader.BatchReader`: batches as dicts (or tuples) of tensors."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from spark_hvd.data.reader import BatchReader


class TorchBatchLoader:
    """Iterate a reader's batches as torch tensors, one epoch per ``iter()``.

    Args:
        reader: the :class:`BatchReader` of this rank.
        feature_cols, label_cols: when given, each batch is ``(features, labels)`` (or ``(features, labels,
            weights)`` with ``sample_weight_col``), each a list of tensors in the given order; otherwise a dict of
            tensors by column.
        sample_weight_col: the weight column of ``(features, labels, weights)`` batches.
        device: where to put the tensors (``None``: CPU).
        intra_op_threads: ``torch.set_num_threads`` for this process (default 1: on small machines copies with
            more threads were erratic; ``None`` leaves torch's setting alone).

    Arrays that share memory with Arrow's (read-only) buffers are copied, so the tensors may be written in place.
    """

    def __init__(
        self,
        reader: BatchReader,
        feature_cols: Sequence[str] | None = None,
        label_cols: Sequence[str] | None = None,
        sample_weight_col: str | None = None,
        device: str | torch.device | None = None,
        intra_op_threads: int | None = 1,
    ) -> None:
        self.reader = reader
        self.feature_cols = list(feature_cols) if feature_cols is not None else None
        self.label_cols = list(label_cols) if label_cols is not None else None
        self.sample_weight_col = sample_weight_col
        self.device = torch.device(device) if device is not None else None
        if intra_op_threads is not None:
            torch.set_num_threads(int(intra_op_threads))
        self._epoch = 0

    def __len__(self) -> int:
        return len(self.reader)

    def epoch(self, epoch: int) -> Iterator[Any]:
        """The batches of epoch ``epoch`` as tensors."""
        for batch in self.reader.epoch(epoch):
            tensors = {k: self._tensor(v) for k, v in batch.items()}
            if self.feature_cols is None:
                yield tensors
                continue
            out: list[Any] = [[tensors[c] for c in self.feature_cols], [tensors[c] for c in self.label_cols or []]]
            if self.sample_weight_col:
                out.append(tensors[self.sample_weight_col])
            yield tuple(out)

    def __iter__(self) -> Iterator[Any]:
        epoch = self._epoch
        self._epoch += 1
        return self.epoch(epoch)

    def _tensor(self, value: np.ndarray) -> torch.Tensor:
        if not value.flags.writeable or not value.flags.c_contiguous:
            value = np.array(value, copy=True, order="C")
        t = torch.from_numpy(value)
        return t.to(self.device) if self.device is not None else t
