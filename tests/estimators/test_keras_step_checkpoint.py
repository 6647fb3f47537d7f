"""KerasEstimator(checkpoint_every_steps=...): rank 1 dies mid-epoch, the retry (``max_retries=1``) resumes at the
exact batch of the last step checkpoint (its model.fit trains only the epoch's remaining batches, counted from
rank 0's batch log), and the final weights and per-epoch losses equal a NumPy replay of data-parallel SGD on the
same batches (each rank's shard read with the reader the ranks use)."""

from __future__ import annotations

import os
import sys

import cloudpickle
import keras
import numpy as np
import pytest
from helpers.torch_replay import rank_shards

from spark_hvd.estimators import KerasEstimator
from spark_hvd.store import Store

pytestmark = [pytest.mark.spark, pytest.mark.slow]

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this test module

EVERY, KILL, BATCH, LR = 3, (1, 4), 16, 0.05  # step checkpoints every 3 steps; rank 1 dies after batch 4 of epoch 1


class _BatchLog(keras.callbacks.Callback):
    """Every rank appends each batch it finished to ``rank<r>.log``; rank 1 dies once after batch ``KILL``."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory, self.epoch = directory, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        import spark_hvd.keras as hvd

        with open(os.path.join(self.directory, f"rank{hvd.rank()}.log"), "a") as f:
            f.write(f"{self.epoch}\n")
        marker = os.path.join(self.directory, "killed")
        if (self.epoch, batch) == KILL and hvd.rank() == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(17)


@pytest.fixture(scope="module")
def df(spark):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 3)).astype(np.float32)
    y = x @ np.array([1.5, -2.0, 0.5], np.float32) + 0.3
    return spark.createDataFrame([(x[i].tolist(), float(y[i])) for i in range(256)], "features array<float>, y double")


def _replay(shards: list, w: np.ndarray, b: np.ndarray, epochs: int) -> tuple[np.ndarray, np.ndarray, list]:
    """Data-parallel SGD on a Dense(1) with Keras's MSE: per step each rank's mean-squared-error gradient, averaged
    over the ranks; the epoch's loss is the mean of the ranks' batch losses (Keras's mean, averaged over ranks)."""
    w, b, losses = w.astype(np.float64), b.astype(np.float64), []
    for epoch in range(epochs):
        batch_losses = []
        for batches in zip(*(s.readers["train"].epoch(epoch) for s in shards), strict=True):
            gw, gb = np.zeros_like(w), np.zeros_like(b)
            for batch in batches:
                x = batch["features"].astype(np.float64)
                err = x @ w + b - batch["y"].astype(np.float64).reshape(-1, 1)
                batch_losses.append(float((err ** 2).mean()))
                gw += 2 * x.T @ err / len(x)
                gb += 2 * err.sum(0) / len(x)
            w, b = w - LR * gw / len(batches), b - LR * gb / len(batches)
        losses.append(float(np.mean(batch_losses)))
    return w, b, losses


@pytest.mark.timeout(600)
def test_a_rank_killed_mid_epoch_resumes_at_the_exact_batch(spark, df, tmp_path):
    store = Store.create(str(tmp_path / "store"))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    w0, b0 = (np.array(v) for v in model.get_weights())
    est = KerasEstimator(num_proc=2, store=store, model=model, optimizer=keras.optimizers.SGD(learning_rate=LR),
                         loss="mse", feature_cols=["features"], label_cols=["y"], batch_size=BATCH, epochs=2,
                         random_seed=1, partitions_per_process=1, verbose=0, max_retries=1,
                         checkpoint_every_steps=EVERY, callbacks=[_BatchLog(str(tmp_path))])
    fitted = est.fit(df)
    assert (tmp_path / "killed").exists()

    shards = rank_shards(store, fitted, seed=1, batch_size=BATCH)
    steps = shards[0].steps("train")
    assert steps == 8
    logged = [int(e) for e in (tmp_path / "rank0.log").read_text().splitlines()]
    # epoch 0, batches 0-4 of epoch 1 (maybe not the 5th on rank 0 as rank 1 died), then the retry: from the step
    # checkpoint after batch 4 of epoch 1 (global batch 12), batches 4-7 only
    assert logged.count(0) == steps and logged.count(1) in (4 + 4, 5 + 4), logged
    w, b, losses = _replay(shards, w0, b0, 2)
    np.testing.assert_allclose(fitted.getHistory()["loss"], losses, rtol=1e-4, atol=1e-6)
    got_w, got_b = fitted.getModel().get_weights()
    np.testing.assert_allclose(got_w, w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got_b, b, rtol=1e-4, atol=1e-5)
