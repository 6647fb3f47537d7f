"""LightningEstimator.fit on local[2] (num_proc=2): digits accuracy, Pipeline save/load, transform, resume."""

from __future__ import annotations

import sys

import cloudpickle
import numpy as np
import pytest
import torch

pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402

from spark_hvd.estimators import LightningEstimator, LightningModel  # noqa: E402
from spark_hvd.store import Store  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.slow]

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class DigitsNet(pl.LightningModule):
    """A small MLP on the 8x8 digits; logs train loss and validation accuracy, steps an LR schedule per epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.cross_entropy(self(batch["pixels"]), batch["digit"])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        logits = self(batch["pixels"])
        self.log("val_acc", (logits.argmax(1) == batch["digit"]).float().mean())
        return torch.nn.functional.cross_entropy(logits, batch["digit"])

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)}


@pytest.fixture(scope="module")
def digits_df(spark):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    rows = [(x[i].tolist(), int(digits.target[i])) for i in range(len(x))]
    return spark.createDataFrame(rows, "pixels array<float>, digit int")


@pytest.mark.compat
def test_digits_pipeline_accuracy_transform_save_load_resume(spark, digits_df, tmp_path):
    from pyspark.ml import Pipeline, PipelineModel

    store = Store.create(str(tmp_path / "store"))
    torch.manual_seed(0)
    est = LightningEstimator(num_proc=2, store=store, model=DigitsNet(), feature_cols=["pixels"],
                             label_cols=["digit"], batch_size=32, epochs=4, validation=0.2, random_seed=3,
                             partitions_per_process=2, verbose=0, run_id="lightning-digits")
    fitted = Pipeline(stages=[est]).fit(digits_df)
    model = fitted.stages[-1]
    assert isinstance(model, LightningModel) and isinstance(model.getModel(), DigitsNet)
    hist = model.getHistory()
    assert set(hist) >= {"loss", "train_loss", "val_acc", "val_loss"} and len(hist["loss"]) == 4, hist
    assert hist["val_acc"][-1] >= 0.9, hist
    assert hist["loss"][-1] < hist["loss"][0]
    assert hist["train_loss"] == pytest.approx(hist["loss"])  # the logged value is the returned loss

    rows = digits_df.limit(50).collect()
    x = torch.tensor([r.pixels for r in rows])
    with torch.no_grad():
        expected = model.getModel()(x).numpy()
    got = np.array([r.digit__output for r in fitted.transform(digits_df.limit(50)).collect()])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)

    fitted.write().overwrite().save(str(tmp_path / "pipeline"))
    loaded = PipelineModel.load(str(tmp_path / "pipeline"))
    again = np.array([r.digit__output for r in loaded.transform(digits_df.limit(50)).collect()])
    np.testing.assert_allclose(again, got, rtol=1e-6)
    assert loaded.stages[-1].getHistory() == hist

    # resume by run_id: two more epochs continue from epoch 4's checkpoint (model, optimizer, LR schedule)
    more = est.copy({est.epochs: 6}).fit(digits_df)
    h2 = more.getHistory()
    assert h2["loss"][:4] == hist["loss"] and len(h2["loss"]) == 6
    assert h2["lr"] == pytest.approx([1e-2 * 0.9**e for e in range(6)])  # the scheduler resumed too
