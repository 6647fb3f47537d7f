"""An unwritable store fails fit on the driver, naming its URL, before any Spark job runs."""

from __future__ import annotations

import pytest
import torch
from helpers.estimators import assert_fit_fails_before_anything_runs

from spark_hvd.estimators import TorchEstimator
from spark_hvd.store import Store, StoreError

pytestmark = pytest.mark.spark


def test_unwritable_store_fails_before_anything_runs(spark, tmp_path):
    (tmp_path / "a_file").write_bytes(b"")
    root = tmp_path / "a_file" / "store"  # a directory under a regular file cannot exist, even for root
    store = Store.create(str(root))
    net = torch.nn.Linear(2, 1)
    est = TorchEstimator(num_proc=1, store=store, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                         loss="mse", feature_cols=["x"], label_cols=["y"], epochs=1)
    df = spark.createDataFrame([([1.0, 2.0], 3.0)], "x array<float>, y double")
    assert_fit_fails_before_anything_runs(spark, est, df, root, "unwritable store", StoreError,
                                          f"the store '{store.url}' is not writable")
