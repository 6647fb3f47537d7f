"""``BaseEstimator.fit``'s driver half (``spark_hvd.estimators.common.fit``): how often it pickles the model.

A large model costs its size in time and memory every time the driver pickles or unpickles it; fit needs one
pickle (the bytes every rank and the forward check start from) and one unpickle (the module the returned
``TorchModel`` holds). The module below counts its own pickles and unpickles in this process (the driver); the
ranks, in Spark's Python workers, count in theirs.
"""

from __future__ import annotations

import sys

import cloudpickle
import numpy as np
import pytest
import torch

from spark_hvd.estimators import TorchEstimator, TorchModel
from spark_hvd.store import Store

pytestmark = [pytest.mark.spark, pytest.mark.slow]

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this module

COUNTS = {"pickled": 0, "unpickled": 0}
_MODULE = __name__


def _count(what: str) -> None:
    """One more ``what`` in this module's ``COUNTS``, found by name: a method pickled by value carries a copy of the
    globals it reads, and unpickling this class in its own process rebinds the class's methods to such copies."""
    module = sys.modules.get(_MODULE)  # None on a rank, which cannot import this module
    if module is not None:
        module.COUNTS[what] += 1


class CountedNet(torch.nn.Module):
    """A linear module that counts how often this process pickles and unpickles it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def __getstate__(self) -> dict:
        _count("pickled")
        return super().__getstate__()

    def __setstate__(self, state: dict) -> None:
        _count("unpickled")
        super().__setstate__(state)


def test_fit_pickles_the_model_once_and_unpickles_it_twice_on_the_driver(spark, tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((48, 3)).astype(np.float32)
    y = x @ np.array([1.0, -1.0, 0.5], dtype=np.float32)
    df = spark.createDataFrame([(r.tolist(), float(t)) for r, t in zip(x, y, strict=True)], ["features", "y"])
    torch.manual_seed(0)
    net = CountedNet()
    est = TorchEstimator(num_proc=1, store=Store.create(str(tmp_path / "store")), model=net,
                         optimizer=torch.optim.SGD(net.parameters(), lr=0.05), loss="mse", feature_cols=["features"],
                         label_cols=["y"], batch_size=16, epochs=1, random_seed=1, verbose=0)
    COUNTS.update(pickled=0, unpickled=0)
    model = est.fit(df)
    # one pickle: the bytes of the spec; unpickled by the forward check and for the returned model's module
    assert COUNTS == {"pickled": 1, "unpickled": 2}
    assert isinstance(model, TorchModel) and type(model.getModel()).__name__ == "CountedNet"
    assert model.getModel() is not net  # the trained copy; the user's module is left as it was
    rows = model.transform(df).collect()
    with torch.no_grad():
        direct = model.getModel()(torch.tensor([r["features"] for r in rows])).numpy()[:, 0]
    assert np.allclose([r["y__output"] for r in rows], direct, rtol=1e-5, atol=1e-6)
