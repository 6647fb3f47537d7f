"""A saved estimator (and model) holds its store's URL and non-secret options only: no key bytes in any file."""

from __future__ import annotations

import io
import json
import os

import pyarrow.parquet as pq
import pytest
import torch

from spark_hvd.estimators import TorchEstimator, TorchModel
from spark_hvd.store import Store
from spark_hvd.store.secrets import STORAGE_OPTIONS_ENV

pytestmark = [pytest.mark.spark]

KEY, SECRET = "AKIAEXAMPLEKEY7Q2W", "zq8T3vLk1NfPr0Yx-SECRET-Ud5sGh2JmWc9"


def _assert_no_secret(path) -> None:
    """Neither the raw bytes of any file under ``path`` nor the decoded Parquet blobs hold a secret."""
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                raw = f.read()
            blobs = [raw]
            if name.endswith(".parquet"):
                for column in pq.read_table(io.BytesIO(raw)).columns:
                    blobs += [v if isinstance(v, bytes) else v.encode() for v in column.to_pylist()
                              if isinstance(v, (bytes, str))]
            for blob in blobs:
                for secret in (KEY, SECRET):
                    assert secret.encode() not in blob, f"{secret} found in {os.path.join(root, name)}"


def test_saved_estimator_and_model_hold_no_secret(spark, tmp_path, monkeypatch):
    monkeypatch.delenv(STORAGE_OPTIONS_ENV, raising=False)
    store = Store.create("s3://bucket/prefix", key=KEY, secret=SECRET, endpoint_url="http://127.0.0.1:9")
    net = torch.nn.Linear(2, 1)
    est = TorchEstimator(num_proc=2, store=store, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                         loss="mse", feature_cols=["x"], label_cols=["y"], epochs=1)
    est.save(str(tmp_path / "est"))
    _assert_no_secret(tmp_path / "est")
    TorchModel(model=net, feature_cols=["x"], label_cols=["y"], run_id="r").save(str(tmp_path / "model"))
    _assert_no_secret(tmp_path / "model")

    loaded = TorchEstimator.load(str(tmp_path / "est"))
    assert loaded.getStore().url == "s3://bucket/prefix"
    assert loaded.getStore().storage_options == {"endpoint_url": "http://127.0.0.1:9"}
    assert loaded.getStore().with_options(key=KEY, secret=SECRET) == store  # the caller gives them back
    monkeypatch.setenv(STORAGE_OPTIONS_ENV, json.dumps({"key": KEY, "secret": SECRET}))
    assert TorchEstimator.load(str(tmp_path / "est")).getStore() == store  # or the environment does
