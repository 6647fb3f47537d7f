"""``mlflow models serve`` on a logged stage: MLflow's scoring server, on loopback, answers a JSON request of raw
rows (image bytes as base64) with the columns ``transform`` adds, equal to ``transform``'s."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from helpers.net import free_port

from spark_hvd.estimators import TorchModel

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def _post(url: str, payload: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_scoring_server_answers_raw_rows_as_transform(spark, mlflow_tracking, tmp_path):
    cli = Path(sys.executable).parent / "mlflow"
    if not cli.exists():
        pytest.skip("no mlflow command in this environment")

    def decode(pdf):  # local: travels by value to the Spark workers and into the pyfunc
        return pd.DataFrame({"image": [np.frombuffer(b, dtype=np.uint8).astype(np.float32) / 255.0
                                       for b in pdf["image"]]})

    torch.manual_seed(7)
    net = torch.nn.Sequential(torch.nn.Linear(16, 3)).eval()
    images = [np.random.default_rng(i).integers(0, 256, 16, dtype=np.uint8).tobytes() for i in range(8)]
    df = spark.createDataFrame([(i, b) for i, b in enumerate(images)], "id long, image binary")
    model = TorchModel(model=net, feature_cols=["image"], label_cols=["label"], transformation_fn=decode,
                       metadata={"classifier": "logits"})
    expect = model.transform(df).orderBy("id").toPandas()
    info = model.log_mlflow(input_example=df)

    port = free_port()
    # MLflow starts its server as `uvicorn` found on PATH: this interpreter's scripts first (make test runs
    # .venv/bin/python without activating the venv)
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"file://{mlflow_tracking}",
           "PATH": os.pathsep.join([str(cli.parent), os.environ.get("PATH", "")])}
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - closed below
    server = subprocess.Popen([str(cli), "models", "serve", "-m", info.model_uri, "--env-manager", "local",
                               "-h", "127.0.0.1", "-p", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=5):
                    break
            except OSError:
                assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the scoring server did not start within 180 s"
                time.sleep(1)
        payload = {"dataframe_split": {"columns": ["image"],
                                       "data": [[base64.b64encode(b).decode()] for b in images]}}
        answer = _post(f"http://127.0.0.1:{port}/invocations", payload)["predictions"]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
        log.close()
    assert [sorted(row) for row in answer] == [["label__output", "prediction", "probability"]] * len(images)
    np.testing.assert_allclose(np.array([row["label__output"] for row in answer]),
                               np.stack(expect["label__output"].to_list()), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal([row["prediction"] for row in answer], expect["prediction"].to_numpy())
    np.testing.assert_allclose(np.array([row["probability"] for row in answer]),
                               np.stack([v.toArray() for v in expect["probability"]]), rtol=1e-5, atol=1e-6)
