"""``KerasEstimator(elastic=True, min_num_proc, max_num_proc)``: a 2-rank fit whose rank 1 dies mid-epoch while its
slot does not come back (a Spark job takes it) goes on with 1 rank from the last step checkpoint. The history
records the ranks of each epoch; the per-epoch losses and the final weights equal a NumPy replay of data-parallel
SGD on exactly the batches the ranks trained (2 ranks' shards up to the checkpoint, then the 1 rank's shard from
the same fraction of the epoch), the batches rank 0 trained are counted from its log. And the elastic params are
checked on the driver before anything runs."""

from __future__ import annotations

import os
import sys

import cloudpickle
import keras
import numpy as np
import pytest
from helpers.estimators import assert_fit_fails_before_anything_runs, die_once, linear_df, tiny_df
from helpers.slot_holder import fit_losing_a_slot
from helpers.torch_replay import rank_shards

from spark_hvd.estimators import KerasEstimator
from spark_hvd.store import Store

pytestmark = pytest.mark.spark

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this test module

EVERY, KILL, BATCH, LR = 3, (1, 4), 16, 0.05  # step checkpoints every 3 steps; rank 1 dies after batch 4 of epoch 1


class _LogAndDieOnce(keras.callbacks.Callback):
    """Rank 0 logs ``epoch size`` of every batch it finished; rank 1 dies (``os._exit``) once, after batch
    ``KILL`` (before the next step checkpoint could be due)."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory, self.epoch = directory, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        import spark_hvd.keras as hvd

        if hvd.rank() == 0:
            with open(os.path.join(self.directory, "batches.log"), "a") as f:
                f.write(f"{self.epoch} {hvd.size()}\n")
        die_once(self.directory, (self.epoch, batch) == KILL and hvd.rank() == 1)


@pytest.fixture(scope="module")
def df(spark):
    return linear_df(spark)


def _sgd_step(batches: list, w: np.ndarray, b: np.ndarray, losses: list) -> tuple[np.ndarray, np.ndarray]:
    """One data-parallel step of a Dense(1) under Keras's MSE: each rank's mean-squared-error gradient on its batch,
    averaged over the ranks, then SGD; each batch's loss (before the step) goes to ``losses``."""
    gw, gb = np.zeros_like(w), np.zeros_like(b)
    for batch in batches:
        x = batch["features"].astype(np.float64)
        err = x @ w + b - batch["y"].astype(np.float64).reshape(-1, 1)
        losses.append(float((err ** 2).mean()))
        gw += 2 * x.T @ err / len(x)
        gb += 2 * err.sum(0) / len(x)
    return w - LR * gw / len(batches), b - LR * gb / len(batches)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_keras_rank_lost_for_good_mid_epoch_the_fit_goes_on_with_fewer_ranks(spark, df, tmp_path, monkeypatch):
    store = Store.create(str(tmp_path / "store"))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    w, b = (np.array(v, np.float64) for v in model.get_weights())
    est = KerasEstimator(num_proc=2, elastic=True, min_num_proc=1, max_num_proc=2, reset_limit=2, store=store,
                         model=model, optimizer=keras.optimizers.SGD(learning_rate=LR), loss="mse",
                         feature_cols=["features"], label_cols=["y"], batch_size=BATCH, epochs=2, random_seed=1,
                         partitions_per_process=1, verbose=0, checkpoint_every_steps=EVERY, checkpoint_upload="sync",
                         callbacks=[_LogAndDieOnce(str(tmp_path))])
    fitted = fit_losing_a_slot(spark, monkeypatch, est, df, str(tmp_path), "spark_hvd-test-keras-slot-holder")
    history = fitted.getHistory()
    assert history["num_proc"] == [2.0, 1.0], history  # epoch 1 ended on the one rank left

    two = rank_shards(store, fitted, seed=1, batch_size=BATCH)
    one = rank_shards(store, fitted, seed=1, batch_size=BATCH, num_proc=1)
    steps2, steps1 = two[0].steps("train"), one[0].steps("train")
    assert (steps2, steps1) == (8, 16)
    # the last step checkpoint is after global batch 12 = 4 batches into epoch 1 on 2 ranks; the 1-rank relaunch
    # resumes at the same fraction of its 16-batch epoch: batch 8, and trains batches 8-15
    resumed = steps1 * 4 // steps2
    logged = [tuple(map(int, line.split())) for line in (tmp_path / "batches.log").read_text().splitlines()]
    assert logged.count((0, 2)) == steps2 and logged.count((1, 2)) in (4, 5), logged  # rank 1 died after batch 4
    assert logged.count((1, 1)) == steps1 - resumed and (0, 1) not in logged, logged

    losses = []
    for epoch in range(2):
        batch_losses: list[float] = []
        pairs = zip(*(s.readers["train"].epoch(epoch) for s in two), strict=True)
        for _ in range(steps2 if epoch == 0 else 4):
            w, b = _sgd_step(list(next(pairs)), w, b, batch_losses)
        if epoch == 1:
            for i, batch in enumerate(one[0].readers["train"].epoch(1)):
                if i >= resumed:
                    w, b = _sgd_step([batch], w, b, batch_losses)
        # Keras's loss is the mean over the epoch's batches (all of 16 rows): the 2 ranks' sums carried over into
        # the one rank's metric variables, then its own batches
        losses.append(float(np.mean(batch_losses)))
    np.testing.assert_allclose(history["loss"], losses, rtol=1e-4, atol=1e-6)
    got_w, got_b = fitted.getModel().get_weights()
    np.testing.assert_allclose(got_w, w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got_b, b, rtol=1e-4, atol=1e-5)
    assert history["loss"][1] < history["loss"][0]


def _kwargs(store, **kw):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    args = dict(num_proc=2, store=store, model=model, optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mse",
                feature_cols=["features"], label_cols=["label"], batch_size=4, epochs=1, verbose=0)
    args.update(kw)
    return args


CASES = [
    ("min above max", dict(elastic=True, min_num_proc=2, max_num_proc=1, num_proc=1),
     r"KerasEstimator: min_num_proc=2 is above max_num_proc=1"),
    ("num_proc outside", dict(elastic=True, min_num_proc=1, max_num_proc=2, num_proc=3),
     r"KerasEstimator: num_proc=3 \(the first launch's ranks\) is outside min_num_proc=1 \.\. max_num_proc=2"),
    ("max without elastic", dict(max_num_proc=2), r"KerasEstimator: max_num_proc=2 is set but elastic is False"),
    ("max_retries with elastic", dict(elastic=True, max_retries=1),
     r"KerasEstimator: max_retries=1 does not go with elastic=True.*reset_limit"),
]


@pytest.fixture(scope="module")
def small_df(spark):
    return tiny_df(spark)


@pytest.mark.parametrize("what,kwargs,match", CASES, ids=[c[0] for c in CASES])
def test_bad_keras_elastic_params_fail_before_anything_runs(spark, small_df, tmp_path, what, kwargs, match):
    root = tmp_path / "store"
    est = KerasEstimator(**_kwargs(Store.create(str(root)), **kwargs))
    assert_fit_fails_before_anything_runs(spark, est, small_df, root, what, ValueError, match)
