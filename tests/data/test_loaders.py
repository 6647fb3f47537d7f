"""The torch and Keras wrappers over BatchReader."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.parquet import write_dataset

from spark_hvd.data.reader import BatchReader


@pytest.fixture
def dataset(tmp_path):
    return write_dataset(tmp_path / "d", 230, width=4)


def test_torch_loader_tensors_match_reader(dataset):
    torch = pytest.importorskip("torch")
    from spark_hvd.data.torch_loader import TorchBatchLoader

    reader = BatchReader(dataset, batch_size=32, shuffle=True, seed=4, rank=1, size=2)
    loader = TorchBatchLoader(reader)
    assert torch.get_num_threads() == 1 and len(loader) == reader.steps_per_epoch
    expected = list(BatchReader(dataset, batch_size=32, shuffle=True, seed=4, rank=1, size=2).epoch(0))
    got = list(loader)  # the first iter() is epoch 0
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g["v"].dtype == torch.float32 and tuple(g["v"].shape) == e["v"].shape
        np.testing.assert_array_equal(g["v"].numpy(), e["v"])
        np.testing.assert_array_equal(g["id"].numpy(), e["id"])
    plain = TorchBatchLoader(BatchReader(dataset, batch_size=50, shuffle=False), ["v", "x"], ["flag"], "id")
    (feats, labels, weights) = next(iter(plain))
    assert [tuple(t.shape) for t in feats] == [(50, 4), (50,)] and labels[0].dtype == torch.bool
    feats[0].add_(1)  # tensors over Arrow's read-only buffers were copied, so in-place writes are safe
    np.testing.assert_array_equal(weights.numpy(), np.arange(50))


def test_keras_dataset_feeds_fit(dataset):
    keras = pytest.importorskip("keras")
    from spark_hvd.data.keras_loader import KerasBatchDataset

    reader = BatchReader(dataset, batch_size=40, shuffle=True, seed=9, columns=["v", "x", "id"])
    ds = KerasBatchDataset(reader, ["v"], ["x"])
    assert len(ds) == 6
    epoch0 = [ds[i] for i in (5, 2, 0, 1, 4, 3)]  # any index order: the next batches of the stream
    expected = list(BatchReader(dataset, batch_size=40, shuffle=True, seed=9, columns=["v", "x", "id"]).epoch(0))
    for (x, y), e in zip(epoch0, expected, strict=True):
        np.testing.assert_array_equal(x, e["v"])
        np.testing.assert_array_equal(y, e["x"])
    assert ds.epoch == 1
    first_of_epoch1 = ds[0][0]
    assert not np.array_equal(first_of_epoch1, epoch0[0][0])  # the next epoch is shuffled differently
    ds.on_epoch_end()  # mid-epoch: restarts epoch 1
    np.testing.assert_array_equal(ds[4][0], first_of_epoch1)
    with pytest.raises(IndexError):
        ds[6]

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    fit_ds = KerasBatchDataset(reader, ["v"], ["x"])
    history = model.fit(fit_ds, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2 and np.isfinite(history.history["loss"]).all()
    assert fit_ds.epoch == 2

    several = KerasBatchDataset(BatchReader(dataset, batch_size=40, columns=["v", "x", "id"]), ["v", "id"], ["x"])
    x, _ = several[0]
    assert isinstance(x, tuple) and len(x) == 2  # Keras's TensorFlow adapter rejects lists in a batch
