"""What a rank reads from the store: its shard of the prepared data (``ShardReaders``); and ``append_history``.
(The run's files, checkpoints, metrics log and final model, are ``spark_hvd.store.run_dir.RunDir``'s.)"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from spark_hvd.data.metadata import model_input_dtype
from spark_hvd.estimators.common.spec import TrainSpec

__all__ = ["ShardReaders", "append_history"]


def append_history(history: dict[str, list[float]], metrics: dict[str, float]) -> None:
    """Add one epoch's metrics to ``history`` (``{name: [per epoch]}``)."""
    for key, value in metrics.items():
        history.setdefault(key, []).append(float(value))


# ------------------------------------------------------------------------------------------------ data glue


class ShardReaders:
    """On a rank: its shard of the prepared train/val data as numpy batches (``spark_hvd.data.BatchReader``).

    Feature columns come as ``model_input_dtype`` arrays of shape ``(rows, *shape)``; labels and weights as stored.
    Every rank yields the same number of training batches per epoch (the reader guarantees it), so the
    collectives of the training step stay in step across ranks.
    """

    def __init__(self, spec: TrainSpec, rank: int, size: int) -> None:
        from spark_hvd.data.reader import BatchReader

        self.spec = spec
        self.info = spec.dataset
        cols = list(spec.feature_cols) + list(spec.label_cols)
        if spec.sample_weight_col:
            cols.append(spec.sample_weight_col)
        # numbers become the model's dtype; bytes, strings, ragged and sparse columns are handed on as the reader
        # gives them (for transformation_fn / collate_fn to turn into arrays)
        padded = spec.ragged == "pad" and spec.transformation_fn is None and spec.collate_fn is None
        numeric = ("scalar", "vector", "array") + (("ragged",) if padded else ())
        self._dtypes = {c: model_input_dtype(self.info.columns[c].dtype) for c in spec.feature_cols
                        if self.info.columns[c].kind in numeric}
        seed = spec.random_seed or 0
        common = {"columns": cols, "rank": rank, "size": size, "seed": seed,
                  "transformation_fn": spec.transformation_fn, "collate_fn": spec.collate_fn,
                  "pool_type": spec.reader_pool_type, "read_ahead_pieces": spec.reader_num_workers,
                  "ragged": spec.ragged}
        self.readers = {"train": BatchReader.from_dataset(
            spec.store, self.info, "train", batch_size=spec.batch_size, shuffle=spec.shuffle, **common)}
        if self.info.has_validation:
            self.readers["val"] = BatchReader.from_dataset(
                spec.store, self.info, "val", batch_size=spec.val_batch_size, shuffle=False, **common)

    @property
    def has_validation(self) -> bool:
        """Whether the dataset has a validation split."""
        return "val" in self.readers

    def steps(self, split: str) -> int:
        """Batches per epoch of ``split`` on every rank."""
        limit = self.spec.train_steps_per_epoch if split == "train" else self.spec.validation_steps_per_epoch
        return int(limit) if limit else len(self.readers[split])

    def epoch(self, split: str, epoch: int, skip: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """Exactly ``steps(split)`` batches (passing over the shard again if ``*_steps_per_epoch`` asks for more),
        less the first ``skip`` (read and dropped: a resume after batch ``skip`` of this epoch; the batches are a
        function of the seed, the epoch and their index, so the next one is the batch an uninterrupted run had)."""
        reader, steps = self.readers[split], self.steps(split)
        done, lap = 0, 0
        while done < steps:
            gen = reader.epoch(epoch * 1000 + lap)
            try:
                for batch in gen:
                    if done >= skip:
                        yield self._cast(batch)
                    done += 1
                    if done >= steps:
                        break
            finally:
                close = getattr(gen, "close", None)
                if close is not None:
                    close()
            lap += 1

    def close(self) -> None:
        """Stop the readers' kept worker processes (``reader_pool_type="process"``); safe to call twice."""
        for reader in self.readers.values():
            reader.close()

    def _cast(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for col, dt in self._dtypes.items():
            arr = batch.get(col)
            if arr is not None and dt is not None and arr.dtype != dt:
                batch[col] = arr.astype(dt)
        return batch
