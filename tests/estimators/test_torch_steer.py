"""A torch loop users can steer, in real two-rank fits: callbacks that stop training and see the optimizer, an LR
scheduler (on a rate scaled by num_proc), best-epoch selection, backward_passes_per_step, gradient_compression,
sample_weight_col, train_minibatch_fn, and a diverging loss that stops the fit with an error naming epoch and step.
backward_passes_per_step, sample_weight_col and the LR scheduler (per epoch and per batch) are each also compared
with the same training replayed in one process (``torch_replay``): same initial module, same batches, same order."""

from __future__ import annotations

import copy
import io
import os
import sys

import cloudpickle
import numpy as np
import pytest
import torch
from helpers.torch_replay import assert_fit_equals_replay, rank_shards, replay

from spark_hvd.estimators import TorchEstimator
from spark_hvd.estimators.torch import EarlyStopping
from spark_hvd.store import RunDir, Store

pytestmark = [pytest.mark.spark, pytest.mark.slow]

cloudpickle.register_pickle_by_value(sys.modules[__name__])

TRUE_W, TRUE_B = np.array([1.5, -2.0, 0.5]), 0.3


@pytest.fixture(scope="module")
def df(spark):
    """512 rows of y = x . w + b (features as an array column); 64 of them have a corrupted label and weight 0."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 3)).astype(np.float32)
    y = x @ TRUE_W + TRUE_B
    bad = np.zeros(512, bool)
    bad[rng.choice(512, 64, replace=False)] = True
    y[bad] += 50.0
    rows = [(x[i].tolist(), float(y[i]), 0.0 if bad[i] else 1.0) for i in range(512)]
    return spark.createDataFrame(rows, "features array<float>, y double, w double")


def _rank() -> int:
    import spark_hvd.torch as hvd

    return hvd.rank()


class LrAndScore:
    """Records every rank's learning rate as each epoch begins (the optimizer it reaches through the context) and adds
    a made-up ``score`` to the logs: 1, 3, 2, 0 by epoch, so epoch 1 is the best and epoch 2 the first miss."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_begin(self, context) -> None:
        self.context = context

    def on_epoch_begin(self, epoch: int) -> None:
        with open(os.path.join(self.directory, f"lr{_rank()}.log"), "a") as f:
            f.write(f"{self.context.optimizer.param_groups[0]['lr']}\n")

    def on_epoch_end(self, epoch: int, logs: dict) -> None:
        logs["score"] = [1.0, 3.0, 2.0, 0.0][epoch]


class CountingMinibatch:
    """A ``train_minibatch_fn``: the default step, counted in a file per rank."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, model, optimizer, transform_outputs, loss_fn, inputs, labels, sample_weights):
        from spark_hvd.estimators.torch.rank import default_train_minibatch

        with open(os.path.join(self.directory, f"steps{_rank()}.log"), "a") as f:
            f.write("1\n")
        return default_train_minibatch(model, optimizer, transform_outputs, loss_fn, inputs, labels, sample_weights)


def _lines(path) -> list[str]:
    with open(path) as f:
        return f.read().split()


def test_early_stopping_lr_scheduler_best_epoch_bpps(spark, df, tmp_path):
    store = Store.create(str(tmp_path / "store"))
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    est = TorchEstimator(
        num_proc=2, store=store, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), loss="mse",
        feature_cols=["features"], label_cols=["y"], sample_weight_col="w", batch_size=16, epochs=4,
        validation=0.2, random_seed=1, partitions_per_process=1, verbose=0, backward_passes_per_step=2,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
        callbacks=[LrAndScore(str(tmp_path)), EarlyStopping(monitor="score", mode="max", patience=1)],
        best_metric="score", best_mode="max", run_id="steer", scale_lr_by_num_proc=True)
    model = est.fit(df)
    hist = model.getHistory()
    assert hist["score"] == [1.0, 3.0, 2.0], "early stopping ended the fit after epoch 2 of 4"
    assert hist["lr"] == pytest.approx([0.2, 0.1, 0.05]), "0.1 scaled by num_proc=2, then halved per epoch"
    for rank in (0, 1):  # the scheduler's rate, seen on every rank
        assert [float(v) for v in _lines(tmp_path / f"lr{rank}.log")] == pytest.approx([0.2, 0.1, 0.05])
    ck = tmp_path / "ck1"
    assert RunDir(store, "steer").latest_checkpoint(str(ck)).epoch == 1, "only improving epochs are checkpointed"
    best = torch.load(io.BytesIO((ck / "model.pt").read_bytes()))
    for name, value in model.getModel().state_dict().items():
        torch.testing.assert_close(value, best[name])  # the returned model is the best epoch's


def test_sample_weights_compression_minibatch_fn(spark, df, tmp_path):
    from spark_hvd.torch import Compression

    store = Store.create(str(tmp_path / "store"))
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    est = TorchEstimator(
        num_proc=2, store=store, model=net, optimizer=torch.optim.Adam(net.parameters(), lr=0.1), loss="mse",
        feature_cols=["features"], label_cols=["y"], sample_weight_col="w", batch_size=16, epochs=5,
        random_seed=1, partitions_per_process=1, verbose=0, gradient_compression=Compression.fp16,
        train_minibatch_fn=CountingMinibatch(str(tmp_path)), train_steps_per_epoch=12)
    model = est.fit(df)
    lin = model.getModel()
    # the 64 corrupted rows (label + 50, weight 0) moved nothing: unweighted, the bias would be off by ~6
    np.testing.assert_allclose(lin.weight.detach().numpy().ravel(), TRUE_W, atol=0.15)
    assert abs(float(lin.bias.detach()) - TRUE_B) < 0.15
    for rank in (0, 1):
        assert len(_lines(tmp_path / f"steps{rank}.log")) == 5 * 12  # every step went through the user's fn


def test_diverging_fit_raises_naming_epoch_and_step(spark, df, tmp_path):
    store = Store.create(str(tmp_path / "store"))
    net = torch.nn.Linear(3, 1)
    est = TorchEstimator(num_proc=2, store=store, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=1e6),
                         loss="mse", feature_cols=["features"], label_cols=["y"], batch_size=16, epochs=2,
                         partitions_per_process=1, verbose=0, run_id="diverge")
    with pytest.raises(Exception, match=r"training loss is (nan|inf).* at epoch 0, step \d+ \(rank [01]\)"):
        est.fit(df)
    assert not store.exists(RunDir(store, "diverge").model_path)


def _halve_per_epoch(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def _decay_per_batch(opt):
    return torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.95)


_REPLAYED = {  # one two-rank fit each, compared with its single-process replay
    "backward_passes_per_step": {"backward_passes_per_step": 2},
    "sample_weight_col": {"sample_weight_col": "w"},
    "lr_scheduler_epoch": {"lr_scheduler": _halve_per_epoch},
    "lr_scheduler_batch": {"lr_scheduler": _decay_per_batch, "lr_scheduler_interval": "batch"},
}


def _mse(model, batch, weight_col=None):
    """The estimator's ``loss="mse"`` on one batch: the mean over rows, or with a weight column the mean of the
    weighted per-row losses (Horovod's mean(w * loss))."""
    out = model(torch.from_numpy(batch["features"]))
    y = torch.from_numpy(batch["y"]).float().reshape(out.shape)
    if weight_col is None:
        return torch.nn.functional.mse_loss(out, y)
    w = torch.from_numpy(batch[weight_col]).float()
    return (((out - y) ** 2).reshape(len(out), -1).mean(1) * w).mean()


def _replay(store, fitted, initial, options: dict) -> tuple[torch.nn.Module, list[float]]:
    """A copy of ``initial`` trained on the fit's batches in one process with the estimator ``options`` of
    ``_REPLAYED``: (model, loss per epoch)."""
    model = copy.deepcopy(initial)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    weight_col = options.get("sample_weight_col")
    shards = rank_shards(store, fitted, seed=1, batch_size=16, sample_weight_col=weight_col)
    losses = replay(shards, model, opt, lambda m, b: _mse(m, b, weight_col), 2,
                    backward_passes_per_step=options.get("backward_passes_per_step", 1),
                    scheduler=options["lr_scheduler"](opt) if "lr_scheduler" in options else None,
                    scheduler_interval=options.get("lr_scheduler_interval", "epoch"))
    return model, losses


@pytest.mark.parametrize("case", sorted(_REPLAYED))
def test_steered_fit_equals_single_process_replay(spark, df, tmp_path, case):
    kw = _REPLAYED[case]
    store = Store.create(str(tmp_path / "store"))
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    initial = copy.deepcopy(net)
    est = TorchEstimator(num_proc=2, store=store, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.05),
                         loss="mse", feature_cols=["features"], label_cols=["y"], batch_size=16, epochs=2,
                         random_seed=1, partitions_per_process=1, verbose=0, **kw)
    fitted = est.fit(df)
    model, losses = _replay(store, fitted, initial, kw)
    assert_fit_equals_replay(fitted, model, losses, atol=1e-5, rtol=1e-4)
    plain, _ = _replay(store, fitted, initial, {})  # the control: without the option the weights differ
    diff = max(float((a - b).abs().max()) for a, b in zip(plain.state_dict().values(),
                                                          model.state_dict().values(), strict=True))
    assert diff > 1e-3, f"{case} changed the replayed weights by only {diff}"
