"""A truncated newest checkpoint: a real TorchEstimator fit with the same run_id resumes from the previous epoch.

Before manifests, any ``_COMMITTED`` marker made a checkpoint count, so a torn ``model.pt`` in the newest epoch made
every later resume (and every ``max_retries`` retry) fail in ``torch.load`` although the epoch before was intact.
"""

from __future__ import annotations

import os
import sys

import cloudpickle
import numpy as np
import pytest
import torch
from helpers.estimators import EpochRecorder, epochs_begun

from spark_hvd.estimators import TorchEstimator
from spark_hvd.store import RunDir, Store

pytestmark = [pytest.mark.spark, pytest.mark.slow]

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class _EpochLog:
    """Callback: every rank logs the epochs it begins (``EpochRecorder``)."""

    def __init__(self, directory: str) -> None:
        self.recorder = EpochRecorder(directory)

    def on_epoch_begin(self, epoch: int) -> None:
        import spark_hvd.torch as hvd

        self.recorder.epoch_begin(hvd.rank(), epoch)


def _fit(store, df, epochs: int, log_dir, seed: int):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(2, 1))
    est = TorchEstimator(num_proc=2, store=store, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                         loss="mse", feature_cols=["x"], label_cols=["y"], batch_size=16, epochs=epochs,
                         random_seed=1, run_id="torn", callbacks=[_EpochLog(str(log_dir))], verbose=0)
    return est.fit(df)


def test_truncated_newest_checkpoint_falls_back_to_the_previous_epoch(spark, tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((128, 2))
    y = x @ np.array([1.0, -1.0]) + 0.5
    df = spark.createDataFrame([([float(a), float(b)], float(t)) for (a, b), t in zip(x, y, strict=True)],
                               "x array<float>, y double")
    store = Store.create(str(tmp_path / "store"))
    first = _fit(store, df, 2, tmp_path, seed=0)
    assert epochs_begun(tmp_path) == [0, 1]
    newest = os.path.join(RunDir(store, "torn").checkpoint_path(1), "model.pt")
    with open(newest, "r+b") as f:  # a torn write: the file lost its second half after the commit
        f.truncate(os.path.getsize(newest) // 2)
    assert store.verify(RunDir(store, "torn").checkpoint_path(1)) is not None

    second = _fit(store, df, 3, tmp_path, seed=123)  # a differently initialised net: only a resume gives epoch 0
    assert epochs_begun(tmp_path) == [0, 1, 1, 2], "resumed after epoch 0, the newest checkpoint that verifies"
    h1, h2 = first.getHistory()["loss"], second.getHistory()["loss"]
    assert len(h2) == 3 and h2[0] == h1[0]  # epoch 0's history came from its checkpoint
    assert RunDir(store, "torn").list_checkpoints() == [0, 1, 2]
    assert all(store.verify(RunDir(store, "torn").checkpoint_path(e)) is None for e in range(3))  # epoch 1 rewritten
