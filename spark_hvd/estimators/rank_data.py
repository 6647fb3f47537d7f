"""What a rank reads and writes in the store: its shard of the prepared data (``ShardReaders``) and the run's
files (``RunFiles``: checkpoints with the history inside, the metrics log, the final model)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from spark_hvd.data.metadata import model_input_dtype
from spark_hvd.estimators.spec import TrainSpec

__all__ = ["RunFiles", "ShardReaders", "append_history"]


class RunFiles:
    """A training run's files in the store, as the ranks use them (rank 0 writes, every rank may read).

    ``runs/<run_id>/checkpoints/epoch-<e>/`` (committed atomically; ``e`` is the 0-based epoch just finished) holds
    the framework's files plus ``state.json`` (``{"epoch": e, "history": {...}}``), so a resumed run continues
    at epoch ``e + 1`` with the history so far. ``runs/<run_id>/logs/metrics.jsonl`` has one JSON line per epoch.
    ``runs/<run_id>/logs/events.out.tfevents.*`` has the same metrics as TensorBoard scalars (``train/<name>``,
    ``val/<name>``, step = epoch; see ``spark_hvd.estimators.tensorboard``).
    ``runs/<run_id>/model/`` holds the final model.
    """

    STATE = "state.json"

    def __init__(self, store: Any, run_id: str) -> None:
        self.store = store
        self.run_id = run_id
        self._events: Any = None

    def latest_checkpoint(self, local_dir: str) -> tuple[int, dict] | None:
        """Download the newest complete checkpoint into ``local_dir``; ``(epoch, history)`` or None."""
        latest = self.store.latest_checkpoint(self.run_id)
        if latest is None:
            return None
        epoch, _ = latest
        self.store.download_checkpoint(self.run_id, epoch, local_dir)
        with open(f"{local_dir}/{self.STATE}") as f:
            state = json.load(f)
        return int(state["epoch"]), dict(state.get("history") or {})

    def write_checkpoint(self, epoch: int, local_dir: str, history: dict) -> None:
        """Commit ``local_dir`` (plus ``state.json``) as the checkpoint of ``epoch``, and the metrics log."""
        with open(f"{local_dir}/{self.STATE}", "w") as f:
            json.dump({"epoch": epoch, "history": history, "time": time.time()}, f)
        self.store.write_checkpoint(self.run_id, epoch, local_dir)
        self.write_metrics(history)

    def write_metrics(self, history: dict) -> None:
        """Rewrite ``logs/metrics.jsonl`` (one line per epoch so far; the store has no append) and the
        TensorBoard event file."""
        n = max((len(v) for v in history.values()), default=0)
        lines = [json.dumps({"epoch": e, **{k: v[e] for k, v in history.items() if e < len(v)}}) for e in range(n)]
        logs = self.store.logs_path(self.run_id)
        self.store.write_bytes(f"{logs}/metrics.jsonl", ("\n".join(lines) + "\n").encode())
        if self._events is None:
            from spark_hvd.estimators.tensorboard import EventFileWriter

            self._events = EventFileWriter(self.store, logs)
        self._events.write_history(history)

    def write_model(self, local_dir: str) -> None:
        """Commit ``local_dir`` as ``runs/<run_id>/model``."""
        with self.store.atomic_dir(self.store.model_path(self.run_id)) as target:
            self.store.upload_dir(local_dir, target)

    def read_model_file(self, name: str) -> bytes:
        """A file of the final model directory."""
        return self.store.read_bytes(f"{self.store.model_path(self.run_id)}/{name}")


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
        self._dtypes = {c: model_input_dtype(self.info.columns[c].dtype) for c in spec.feature_cols
                        if self.info.columns[c].kind in ("scalar", "vector", "array")}
        seed = spec.random_seed or 0
        common = {"columns": cols, "rank": rank, "size": size, "seed": seed,
                  "transformation_fn": spec.transformation_fn, "collate_fn": spec.collate_fn,
                  "pool_type": spec.reader_pool_type, "read_ahead_pieces": spec.reader_num_workers}
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

    def epoch(self, split: str, epoch: int) -> Iterator[dict[str, np.ndarray]]:
        """Exactly ``steps(split)`` batches (passing over the shard again if ``*_steps_per_epoch`` asks for more)."""
        reader, steps = self.readers[split], self.steps(split)
        done, lap = 0, 0
        while done < steps:
            gen = reader.epoch(epoch * 1000 + lap)
            try:
                for batch in gen:
                    yield self._cast(batch)
                    done += 1
                    if done >= steps:
                        break
            finally:
                close = getattr(gen, "close", None)
                if close is not None:
                    close()
            lap += 1

    def _cast(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for col, dt in self._dtypes.items():
            arr = batch.get(col)
            if arr is not None and dt is not None and arr.dtype != dt:
                batch[col] = arr.astype(dt)
        return batch
