"""Retention by score: ``keep_best_checkpoints`` keeps the best K epoch checkpoints by ``monitor`` beside the newest
``keep_checkpoints``, and ``final_model="best"`` makes the kept checkpoint best by ``monitor`` the final model
(rank 0's ``RankRun`` over a real local store); and the driver's checks of these params."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from spark_hvd.estimators.common.rank_run import RankRun
from spark_hvd.estimators.common.retention import best_epochs, kept_epochs
from spark_hvd.estimators.common.spec import BestPolicy
from spark_hvd.store import RunDir, Store

RUN = "retention-run"
VAL_LOSS = [0.9, 0.5, 0.7, 0.4, 0.8, 0.6]  # best by min: epochs 3, 1, 5, 2, 4, 0


class _Trainer:
    """The state is a number written as the checkpoint's file (what ``RankRun`` needs of a framework here)."""

    hvd = SimpleNamespace(broadcast_object=lambda value, root_rank: value)

    def __init__(self) -> None:
        self.weights = 0

    def save_checkpoint(self, directory: str) -> None:
        with open(os.path.join(directory, "weights.json"), "w") as f:
            json.dump({"weights": self.weights}, f)

    def load_checkpoint(self, directory: str) -> None:
        with open(os.path.join(directory, "weights.json")) as f:
            self.weights = json.load(f)["weights"]


def _train(store: Store, **spec) -> tuple[RankRun, _Trainer]:
    spec = SimpleNamespace(**{**dict(store=store, run_id=RUN, best=None, checkpoint_upload="sync",
                                     checkpoint_when_busy="wait", keep_checkpoints=None, keep_best_checkpoints=None,
                                     monitor=None, final_model="last"), **spec})
    trainer = _Trainer()
    run = RankRun(spec, trainer)
    for epoch, value in enumerate(VAL_LOSS):
        trainer.weights = 100 + epoch
        run.end_epoch(epoch, {"loss": 1.0, "val_loss": value})
    run.writer.wait()
    return run, trainer


def test_best_epochs_rank_by_the_mode_ties_to_the_earlier():
    history = {"val_loss": VAL_LOSS, "acc": [0.1, 0.3, 0.3, 0.2]}
    assert best_epochs(range(6), history, BestPolicy.create("val_loss")) == [3, 1, 5, 2, 4, 0]
    assert best_epochs(range(6), history, BestPolicy.create("acc")) == [1, 2, 3, 0]  # auto: max; epochs 4, 5 unscored
    assert kept_epochs([0, 1, 2], history, None, None, None) == {0, 1, 2}
    assert kept_epochs(range(6), history, None, 2, BestPolicy.create("val_loss")) == {5, 3, 1}  # newest one + best 2
    assert kept_epochs(range(6), history, 2, 1, BestPolicy.create("val_loss")) == {4, 5, 3}


def test_the_best_k_by_monitor_and_the_newest_n_are_kept(tmp_path):
    store = Store.create(str(tmp_path / "store"))
    _train(store, keep_checkpoints=1, keep_best_checkpoints=2, monitor=BestPolicy.create("val_loss"))
    assert RunDir(store, RUN).list_checkpoints() == [1, 3, 5]  # best 3 and 1, newest 5
    found = RunDir(store, RUN).latest_checkpoint(str(tmp_path / "latest"))
    assert found.epoch == 5, "a resume must start after the newest epoch, not the best"


def test_final_model_best_loads_the_best_kept_checkpoint(tmp_path):
    store = Store.create(str(tmp_path / "store"))
    run, trainer = _train(store, keep_best_checkpoints=1, monitor=BestPolicy.create("val_loss"), final_model="best")
    assert trainer.weights == 105
    run._load_best()
    assert (trainer.weights, run.final_epoch) == (103, 3)
    maxed = Store.create(str(tmp_path / "store2"))  # max mode: epoch 0 is the best
    run, trainer = _train(maxed, monitor=BestPolicy.create("val_loss", "max"), final_model="best")
    run._load_best()
    assert (trainer.weights, run.final_epoch) == (100, 0)


def test_final_model_best_without_the_monitor_in_the_history_keeps_the_last_state(tmp_path, caplog):
    store = Store.create(str(tmp_path / "store"))
    run, trainer = _train(store, monitor=BestPolicy.create("val_auc"), final_model="best")
    run._load_best()
    assert (trainer.weights, run.final_epoch) == (105, None)
    assert "no kept checkpoint has a 'val_auc' value" in caplog.text


# ------------------------------------------------------------------------------------------------ driver checks
@pytest.fixture(scope="module")
def small_df(spark):
    return spark.createDataFrame([([float(i), 1.0], float(i)) for i in range(8)],
                                 "features array<double>, label double")


CASES = [
    ("keep best without monitor", dict(keep_best_checkpoints=2), r"keep_best_checkpoints rank the checkpoints by "
     r"monitor: set monitor"),
    ("best final model without monitor", dict(final_model="best"), r"final_model='best' rank the checkpoints"),
    ("val monitor without validation", dict(monitor="val_loss", final_model="best"),
     r"monitor='val_loss' is a validation metric but validation is not set"),
    ("with best_metric", dict(monitor="loss", keep_best_checkpoints=1, best_metric="loss"),
     r"keep_best_checkpoints does not go with best_metric"),
    ("zero kept", dict(monitor="loss", keep_best_checkpoints=0), r"keep_best_checkpoints must be a positive integer"),
]


@pytest.mark.spark
@pytest.mark.parametrize("what,kwargs,match", CASES, ids=[c[0] for c in CASES])
def test_bad_retention_params_fail_before_anything_runs(spark, small_df, tmp_path, what, kwargs, match):
    import torch
    from helpers.estimators import assert_fit_fails_before_anything_runs

    from spark_hvd.estimators import TorchEstimator

    root = tmp_path / "store"
    torch.manual_seed(0)
    net = torch.nn.Linear(2, 1)
    est = TorchEstimator(num_proc=2, store=Store.create(str(root)), model=net, loss="mse", batch_size=4,
                         optimizer=torch.optim.SGD(net.parameters(), lr=0.1), feature_cols=["features"],
                         label_cols=["label"], verbose=0, **kwargs)
    assert_fit_fails_before_anything_runs(spark, est, small_df, root, what, ValueError, match)


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_fit_with_final_model_best_returns_that_epochs_weights(spark, tmp_path):
    """monitor='loss' in max mode picks the worst epoch (the first: the loss falls), so the returned module must be
    epoch 0's checkpoint, not the last state; the checkpoints kept are the newest and that one."""
    import io

    import numpy as np
    import torch

    from spark_hvd.estimators import TorchEstimator

    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 2))
    df = spark.createDataFrame([(x[i].tolist(), float(x[i] @ [2.0, -1.0])) for i in range(64)],
                               "features array<double>, label double")
    store = Store.create(str(tmp_path / "store"))
    torch.manual_seed(0)
    net = torch.nn.Linear(2, 1)
    est = TorchEstimator(num_proc=2, store=store, model=net, loss="mse", batch_size=8, epochs=3, random_seed=1,
                         optimizer=torch.optim.SGD(net.parameters(), lr=0.1), feature_cols=["features"],
                         label_cols=["label"], verbose=0, partitions_per_process=1, keep_best_checkpoints=1,
                         monitor="loss", monitor_mode="max", final_model="best")
    fitted = est.fit(df)
    losses = fitted.getHistory()["loss"]
    assert losses[0] > losses[1] > losses[2]
    run_dir = RunDir(store, fitted.getRunId())
    assert run_dir.list_checkpoints() == [0, 2] and fitted.getMetadata()["final_epoch"] == 0
    for epoch, same in ((0, True), (2, False)):
        saved = torch.load(io.BytesIO(store.read_bytes(f"{run_dir.checkpoint_path(epoch)}/model.pt")))
        equal = all(torch.equal(saved[k], v) for k, v in fitted.getModel().state_dict().items())
        assert equal is same, f"the returned weights {'differ from' if same else 'equal'} epoch {epoch}'s"
