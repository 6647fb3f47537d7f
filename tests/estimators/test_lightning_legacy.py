"""A plain ``torch.nn.Module`` given to ``LightningEstimator`` with ``optimizer``, ``loss`` and ``sample_weight_col``
(Horovod's legacy Lightning estimator, its ``test_legacy_fit_model``), each compared with the weighted binary cross
entropy written out by hand and plain SGD on the same batches: ``LegacyModule`` trained by Lightning's Trainer in
this process (no Spark: in ``make test``); the two-rank fit on local[2], whose ``getModel()`` is the trained plain
module and whose ``profiler="simple"`` left each rank's report in the run's logs (``mp_start_method`` set too;
marker ``horovodfit``, 30-60 s at load 6-18: not in ``make test``, ``make horovod-fits``); a plain module without an
optimizer, and an unknown profiler, refused on the driver before any Spark job."""

from __future__ import annotations

import copy
import sys

import cloudpickle
import numpy as np
import pytest
import torch
from helpers.estimators import assert_fit_fails_before_anything_runs
from helpers.torch_replay import assert_fit_equals_replay, rank_shards, replay

pytest.importorskip("lightning")

from spark_hvd.estimators import LightningEstimator  # noqa: E402
from spark_hvd.store import Store  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class XOR(torch.nn.Module):
    """Horovod's ``LegacyXOR``: forward takes the feature column by name."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2 = torch.nn.Linear(2, 8), torch.nn.Linear(8, 1)

    def forward(self, features):
        return torch.sigmoid(self.lin2(torch.tanh(self.lin1(features.float()))))


@pytest.fixture(scope="module")
def df(spark):
    """128 noisy XOR rows with a weight in [0, 1)."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2, (128, 2)).astype(np.float32)
    y = (x[:, 0] != x[:, 1]).astype(np.float32)
    x += rng.normal(0, 0.1, x.shape).astype(np.float32)
    w = rng.uniform(0, 1, 128)
    return spark.createDataFrame([(x[i].tolist(), float(y[i]), float(w[i])) for i in range(128)],
                                 "features array<float>, y float, weight double")


def _weighted_bce(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """sum(w * bce) / sum(w) over a reader's batch, by hand."""
    p = model(torch.from_numpy(batch["features"])).reshape(-1)
    y, w = torch.from_numpy(batch["y"]).float(), torch.from_numpy(batch["weight"]).float()
    return (w * -(y * torch.log(p) + (1 - y) * torch.log(1 - p))).mean()


def _replay(model: torch.nn.Module, batches: list[dict], epochs: int, lr: float) -> torch.nn.Module:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(epochs):
        for batch in batches:
            opt.zero_grad()
            _weighted_bce(model, {k: v.numpy() for k, v in batch.items()}).backward()
            opt.step()
    return model


def test_legacy_module_trains_as_the_torch_step_in_lightning():
    import lightning.pytorch as pl

    from spark_hvd.estimators.lightning.legacy import LegacyModule
    from spark_hvd.estimators.torch.serde import optimizer_spec

    torch.manual_seed(0)
    net = XOR()
    initial = copy.deepcopy(net)
    gen = torch.Generator().manual_seed(1)
    batches = [{"features": torch.rand(8, 2, generator=gen), "y": torch.randint(0, 2, (8,), generator=gen).float(),
                "weight": torch.rand(8, generator=gen, dtype=torch.float64)} for _ in range(4)]
    module = LegacyModule(net, optimizer_spec(torch.optim.SGD(net.parameters(), lr=0.5), net),
                          torch.nn.functional.binary_cross_entropy, None, (), ["features"], ["y"], "weight")
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=None)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    want = _replay(copy.deepcopy(initial), batches, 2, 0.5)
    for (name, got), ref in zip(net.state_dict().items(), want.state_dict().values(), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    moved = max(float((a - b).abs().max()) for a, b in zip(initial.state_dict().values(),
                                                           want.state_dict().values(), strict=True))
    assert moved > 1e-2, f"the replay moved the weights by only {moved}"


@pytest.mark.spark
@pytest.mark.horovodfit
def test_plain_module_fit_equals_single_process_replay(spark, df, tmp_path):
    store = Store.create(str(tmp_path / "store"))
    torch.manual_seed(0)
    net = XOR()
    initial = copy.deepcopy(net)
    est = LightningEstimator(num_proc=2, store=store, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.5),
                             loss=torch.nn.functional.binary_cross_entropy, feature_cols=["features"],
                             label_cols=["y"], sample_weight_col="weight", batch_size=16, epochs=2, random_seed=1,
                             partitions_per_process=1, verbose=0, profiler="simple",
                             mp_start_method="spawn")
    fitted = est.fit(df)
    for rank in (0, 1):  # Lightning's SimpleProfiler report of each rank's fit, as Horovod keeps it in the logs
        logs = store.path("runs", fitted.getRunId(), "logs", "profiler", f"rank{rank}")
        reports = [f for f in store.listdir(logs) if f.startswith("fit-profile")]
        assert reports and "run_training_epoch" in store.read_bytes(f"{logs}/{reports[0]}").decode()
    trained = fitted.getModel()
    assert type(trained) is XOR  # the plain module, as Horovod returns it
    assert trained(torch.ones([1, 2], dtype=torch.int32)).dtype == torch.float32
    model = copy.deepcopy(initial)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    shards = rank_shards(store, fitted, seed=1, batch_size=16, sample_weight_col="weight")
    losses = replay(shards, model, opt, _weighted_bce, 2)
    assert_fit_equals_replay(fitted, model, losses, atol=1e-5, rtol=1e-4)
    moved = max(float((a - b).abs().max()) for a, b in zip(initial.state_dict().values(),
                                                           model.state_dict().values(), strict=True))
    assert moved > 1e-2, f"the replay moved the weights by only {moved}"


@pytest.mark.spark
def test_plain_module_without_optimizer_is_refused_on_the_driver(spark, df, tmp_path):
    est = LightningEstimator(num_proc=2, store=Store.create(str(tmp_path / "store")), model=XOR(),
                             loss=torch.nn.functional.binary_cross_entropy, feature_cols=["features"],
                             label_cols=["y"], epochs=1)
    assert_fit_fails_before_anything_runs(spark, est, df, tmp_path / "store", "plain module, no optimizer",
                                          ValueError, "XOR is a plain torch.nn.Module: set optimizer and loss")
    net = XOR()
    est = LightningEstimator(num_proc=2, store=Store.create(str(tmp_path / "store")), model=net,
                             optimizer=torch.optim.SGD(net.parameters(), lr=0.5),
                             loss=torch.nn.functional.binary_cross_entropy, feature_cols=["features"],
                             label_cols=["y"], epochs=1, profiler="simpel")
    assert_fit_fails_before_anything_runs(spark, est, df, tmp_path / "store", "unknown profiler", ValueError,
                                          r"profiler must be one of \('simple', 'advanced', 'pytorch'\)")
