"""``fit_on_parquet`` on a dataset written by petastorm (tests/data/fixtures/petastorm_small): the ranks decode its
NdarrayCodec and CompressedImageCodec columns and train on them, nothing copied into the store."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from spark_hvd.estimators import TorchEstimator  # noqa: E402
from spark_hvd.store import Store  # noqa: E402

DATASET = os.path.join(os.path.dirname(__file__), "fixtures", "petastorm_small")


@pytest.mark.spark
@pytest.mark.slow
def test_fit_on_parquet_trains_on_a_petastorm_dataset(spark, tmp_path):
    """The ranks decode the NdarrayCodec column (4 x 3 float32 per row) and train on it: the loss falls, and the
    fitted network's error on the arrays petastorm's own reader decoded is below the first epoch's loss."""
    with np.load(os.path.join(os.path.dirname(DATASET), "petastorm_small_expected.npz")) as z:
        matrix, weight = z["matrix"], z["weight"]
    store = Store.create(str(tmp_path / "store"))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 1))
    est = TorchEstimator(num_proc=2, store=store, model=net, optimizer=torch.optim.Adam(net.parameters(), lr=0.05),
                         loss="mse", feature_cols=["matrix"], label_cols=["weight"],
                         batch_size=10, epochs=3, random_seed=1, verbose=0)
    model = est.fit_on_parquet(DATASET)
    hist = model.getHistory()["loss"]
    assert len(hist) == 3 and hist[-1] < hist[0], hist
    assert not store.exists(store.data_root()) or not store.listdir(store.data_root())
    with torch.no_grad():  # the fitted network takes the arrays petastorm decodes
        out = model.getModel()(torch.from_numpy(matrix)).numpy().reshape(-1)
    assert np.mean((out - weight) ** 2) < hist[0]
