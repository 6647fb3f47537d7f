"""MLflow logged live: each epoch's metrics reach the tracking store while the next epoch trains; the logged model
has a signature and an input example, is registered under ``registered_model_name``, and predicts through
``mlflow.pyfunc`` what ``transform`` gives. Run on the Spark Connect session (the classic path is the same code,
also exercised by the MLflow checks of test_torch_fit.py and test_keras_fit.py).

The tracking store is MLflow's local file store (``mlflow_tracking``), which also holds the model registry; a
SQLite-backed server is not tried: mlflow-skinny comes without sqlalchemy."""

from __future__ import annotations

import json
import os
import sys
import time

import cloudpickle
import numpy as np
import pandas as pd
import pytest

pytestmark = [pytest.mark.spark, pytest.mark.slow]

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class _SeesLiveMetrics:
    """Rank 0, as epoch ``epoch`` begins: waits (bounded) until the tracking store shows the finished epochs'
    loss, and records what it saw in ``out``."""

    def __init__(self, tracking_uri: str, experiment: str, epoch: int, out: str) -> None:
        self.tracking_uri, self.experiment, self.epoch, self.out = tracking_uri, experiment, epoch, out

    def on_epoch_begin(self, epoch: int) -> None:
        import spark_hvd.torch as hvd

        if hvd.rank() != 0 or epoch != self.epoch:
            return
        from mlflow.tracking import MlflowClient

        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # the executors' environment predates the test's
        client = MlflowClient(self.tracking_uri)
        steps: list[int] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            exp = client.get_experiment_by_name(self.experiment)
            runs = client.search_runs([exp.experiment_id]) if exp else []
            if runs:
                steps = sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "loss"))
                if len(steps) >= epoch:
                    break
            time.sleep(0.2)
        with open(self.out, "w") as f:
            json.dump(steps, f)


def test_live_metrics_signature_registry_and_pyfunc_on_connect(connect_mode, mlflow_tracking, tmp_path):
    import mlflow
    import torch
    from sklearn.datasets import load_digits

    from spark_hvd.estimators import TorchEstimator
    from spark_hvd.store import Store

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    df = connect_mode.createDataFrame([(x[i].tolist(), int(digits.target[i])) for i in range(len(x))],
                                      "pixels array<float>, digit int")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    seen = str(tmp_path / "seen.json")
    est = TorchEstimator(num_proc=2, store=Store.create(str(tmp_path / "store")), model=net,
                         optimizer=torch.optim.Adam(net.parameters(), lr=1e-2), loss="cross_entropy",
                         feature_cols=["pixels"], label_cols=["digit"], batch_size=64, epochs=3, random_seed=3,
                         partitions_per_process=2, verbose=0,
                         callbacks=[_SeesLiveMetrics(f"file://{mlflow_tracking}", "live", 2, seen)],
                         mlflow={"experiment": "live", "registered_model_name": "spark_hvd_digits"})
    model = est.fit(df)

    with open(seen) as f:
        assert json.load(f) == [0, 1], "epochs 0 and 1 were in MLflow while epoch 2 trained"
    client = mlflow.tracking.MlflowClient()
    exp = mlflow.get_experiment_by_name("live")
    (run,) = mlflow.search_runs([exp.experiment_id], output_format="list")
    history = sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)
    assert [m.step for m in history] == [0, 1, 2]
    assert [m.value for m in history] == pytest.approx(model.getHistory()["loss"])
    assert run.info.status == "FINISHED"

    (version,) = client.search_model_versions("name='spark_hvd_digits'")
    uri = f"models:/spark_hvd_digits/{version.version}"
    info = mlflow.models.get_model_info(uri)
    assert info.signature is not None and info.saved_input_example_info is not None
    assert list(info.signature.inputs.to_dict()[0]["tensor-spec"]["shape"]) == [-1, 64]
    local = mlflow.artifacts.download_artifacts(uri)
    example = mlflow.models.Model.load(os.path.join(local, "MLmodel")).load_input_example(local)
    np.testing.assert_allclose(example, x[:5], rtol=1e-6)  # the first training rows, as transform feeds them

    pyfunc = mlflow.pyfunc.load_model(uri)
    scored = model.transform(df.limit(50)).toPandas()
    expected = np.stack(scored["digit__output"].to_list())
    np.testing.assert_allclose(np.asarray(pyfunc.predict(x[:50])), expected, rtol=1e-5, atol=1e-5)

    # the whole stage beside it: raw rows in, transform's columns out (prediction, probability too)
    stage = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/stage")
    got = stage.predict(pd.DataFrame({"pixels": [row.tolist() for row in x[:50]]}))
    assert list(got.columns) == ["digit__output", "prediction", "probability"]
    np.testing.assert_allclose(np.stack(got["digit__output"].to_list()), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got["prediction"].to_numpy(), scored["prediction"].to_numpy())
    np.testing.assert_allclose(np.stack(got["probability"].to_list()),
                               np.stack([v.toArray() for v in scored["probability"]]), rtol=1e-5, atol=1e-6)
