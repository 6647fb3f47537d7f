"""Serving a fitted stage four ways, against what each one should match (issue 42's targets), in one invocation.

- ``mlflow.pyfunc.spark_udf`` over the logged pyfunc vs ``TorchModel.transform``, rows/s on the same cached
  DataFrame, written to the noop sink (target: >= 0.8x), and ``transform`` vs Spark's Arrow round trip with no model
  (``_timing.arrow_floor_run``; target: >= 1.0x); ``transform`` of the classifier (its columns in numpy inside the
  Arrow function) vs the raw output plus the same columns as Spark SQL expressions (``add_classifier_columns``, how
  ``transform`` made them before), and ``spark_udf`` over the same pyfunc logged with ``check_input=False`` (MLflow
  then checks no input schema: its per-row check of an array column is most of ``spark_udf``'s time). All are
  timed in turn (a, b, c, a, b, c, ...) so that a load that changes during the run weighs on all alike.
- MLflow's scoring server (``mlflow models serve``, loopback) answering a 64-row JSON batch vs the same pyfunc
  called in process on the same 64 rows: median latency of ``--requests`` each, in turn (target: <= 2x).
- ONNX through onnxruntime on the CPU vs the torch module, rows/s on in-memory batches (target: >= 1.0x); only where
  onnxruntime imports (the ``export`` extra), else recorded as skipped.

The model is the digits MLP of ``examples/demo.py`` (64 -> 64 -> 10, a classifier: ``prediction`` and
``probability`` beside the logits), trained a few steps in process on sklearn's digits; the scored rows are
random 64-wide float arrays in [0, 1) made in Spark.

Run: ``python benchmarks/serving.py [--rows 200000] [--repeats 5] [--requests 100] [--out results.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

from _timing import arrow_floor_run, finish, start

WIDTH = 64


def digits_mlp() -> Any:
    """The demo's 64-64-10 MLP, trained 30 full-batch Adam steps on sklearn's digits (so its weights are not
    the initial ones)."""
    import torch
    from sklearn.datasets import load_digits

    torch.manual_seed(0)
    digits = load_digits()
    x = torch.from_numpy((digits.data / 16.0).astype("float32"))
    y = torch.from_numpy(digits.target.astype("int64"))
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(30):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return net.eval()


def _rows_df(spark: Any, rows: int) -> Any:
    from pyspark.sql import functions as F  # noqa: N812

    cols = [F.rand(7 * 100 + i).cast("float") for i in range(WIDTH)]
    return spark.range(rows).select(F.col("id"), F.array(*cols).alias("features"))


def _in_turn(fns: dict[str, Any], repeats: int) -> dict[str, float]:
    """Median seconds of each function of ``fns``, called in turn ``repeats`` times."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_spark(spark: Any, model: Any, uri: str, rows: int, repeats: int, uri_unchecked: str | None = None) -> dict:
    """spark_udf over the logged pyfunc vs transform (both with the classifier's prediction and probability), and
    transform of the raw network output (one column, as the floor adds one) vs the Arrow round trip with no model,
    rows/s on the same DataFrame."""
    import mlflow.pyfunc
    from pyspark.sql import functions as F  # noqa: N812

    from spark_hvd.estimators import TorchModel
    from spark_hvd.estimators.common.classifier import add_classifier_columns

    cores = spark.sparkContext.defaultParallelism
    df = _rows_df(spark, rows).repartition(cores).cache()
    df.count()
    result_type = "label__output array<float>, prediction double, probability array<double>"
    udf = mlflow.pyfunc.spark_udf(spark, uri, env_manager="local", result_type=result_type)
    unchecked = mlflow.pyfunc.spark_udf(spark, uri_unchecked, env_manager="local", result_type=result_type) \
        if uri_unchecked else None
    raw = TorchModel(model=model.getModel(), feature_cols=["features"], label_cols=["label"], batch_size=1024)

    def run_transform() -> None:
        model.transform(df).write.format("noop").mode("overwrite").save()

    def run_udf() -> None:
        df.withColumn("out", udf(F.struct("features"))).select("id", "features", "out.*") \
            .write.format("noop").mode("overwrite").save()

    def run_udf_unchecked() -> None:  # the pyfunc logged with check_input=False: no input schema to check
        df.withColumn("out", unchecked(F.struct("features"))).select("id", "features", "out.*") \
            .write.format("noop").mode("overwrite").save()

    def run_raw() -> None:
        raw.transform(df).write.format("noop").mode("overwrite").save()

    def run_sql_classifier() -> None:  # the classifier columns as before: Spark SQL expressions on the raw output
        add_classifier_columns(raw.transform(df), "label__output", "logits", "prediction", "probability") \
            .write.format("noop").mode("overwrite").save()

    fns = {"transform": run_transform, "spark_udf": run_udf, "transform_raw": run_raw,
           "transform_sql_classifier": run_sql_classifier, "arrow_floor": arrow_floor_run(df, "label__output")}
    if unchecked is not None:
        fns["spark_udf_unchecked"] = run_udf_unchecked
    for fn in fns.values():
        fn()  # warm: Python workers, the model in each worker's cache
    t = _in_turn(fns, repeats)
    df.unpersist()
    rate = {k: rows / v for k, v in t.items()}
    return {"rows": rows, "partitions": cores, "repeats": repeats,
            **{f"{k}_rows_per_s": v for k, v in rate.items()},
            "spark_udf_vs_transform (>= 0.8)": rate["spark_udf"] / rate["transform"],
            "transform_vs_sql_classifier": rate["transform"] / rate["transform_sql_classifier"],
            **({"spark_udf_unchecked_vs_transform": rate["spark_udf_unchecked"] / rate["transform"]}
               if unchecked is not None else {}),
            "transform_raw_vs_arrow_floor (>= 1.0)": rate["transform_raw"] / rate["arrow_floor"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: bytes) -> dict:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def bench_server(uri: str, tracking: str, requests: int) -> dict:
    """The scoring server's latency for a 64-row JSON batch vs the pyfunc in process (median of ``requests``)."""
    import mlflow.pyfunc
    import numpy as np
    import pandas as pd

    cli = os.path.join(os.path.dirname(sys.executable), "mlflow")
    if not os.path.exists(cli):
        return {"skipped": f"no mlflow command beside {sys.executable}"}
    x = np.random.default_rng(3).random((64, WIDTH), dtype=np.float32)
    pdf = pd.DataFrame({"features": list(x)})
    body = json.dumps({"dataframe_split": {"columns": ["features"],
                                           "data": [[row.tolist()] for row in x]}}).encode()
    loaded = mlflow.pyfunc.load_model(uri)
    port = _free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking,
           "PATH": os.pathsep.join([os.path.dirname(cli), os.environ.get("PATH", "")])}
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)  # noqa: SIM115 - closed below
    server = subprocess.Popen([cli, "models", "serve", "-m", uri, "--env-manager", "local", "-h", "127.0.0.1",
                               "-p", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{url}/ping", timeout=5):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    return {"skipped": f"the scoring server did not start (log: {log.name})"}
                time.sleep(1)
        answer = _post(f"{url}/invocations", body)["predictions"]
        direct = loaded.predict(pdf)
        np.testing.assert_allclose(np.array([r["label__output"] for r in answer]),
                                   np.stack(direct["label__output"].to_list()), rtol=1e-5, atol=1e-6)
        for _ in range(5):  # warm both
            _post(f"{url}/invocations", body)
            loaded.predict(pdf)
        t = _in_turn({"server": lambda: _post(f"{url}/invocations", body), "in_process": lambda: loaded.predict(pdf)},
                     requests)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
        log.close()
    return {"batch_rows": 64, "requests": requests, "server_median_ms": t["server"] * 1e3,
            "in_process_median_ms": t["in_process"] * 1e3,
            "server_vs_in_process (<= 2.0)": t["server"] / t["in_process"]}


def bench_onnx(model: Any, rows: int, repeats: int) -> dict:
    """onnxruntime (CPU) vs the torch module on the same in-memory float32 batches of 1024 rows."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        return {"skipped": f"onnxruntime does not import here ({exc}); install spark_hvd[export] to measure"}
    import numpy as np
    import torch

    x = np.random.default_rng(4).random((rows, WIDTH), dtype=np.float32)
    directory = tempfile.mkdtemp(prefix="serving-onnx-")
    info = model.export(directory, format="onnx", example=[x[:8]])  # a stage not made by fit: no recorded shapes
    path = os.path.join(directory, info.get("file", "model.onnx")) if isinstance(info, dict) else directory
    if not os.path.isfile(path):
        path = next(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".onnx"))
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    net = model.getModel()
    xt = torch.from_numpy(x)

    def run_torch() -> None:
        with torch.inference_mode():
            for i in range(0, rows, 1024):
                net(xt[i:i + 1024])

    def run_onnx() -> None:
        for i in range(0, rows, 1024):
            session.run(None, {name: x[i:i + 1024]})

    with torch.inference_mode():
        np.testing.assert_allclose(session.run(None, {name: x[:1024]})[0], net(xt[:1024]).numpy(), rtol=1e-4,
                                   atol=1e-5)
    t = _in_turn({"torch": run_torch, "onnx": run_onnx}, repeats)
    return {"rows": rows, "threads": torch.get_num_threads(), "torch_rows_per_s": rows / t["torch"],
            "onnxruntime_rows_per_s": rows / t["onnx"], "onnx_vs_torch (>= 1.0)": t["torch"] / t["onnx"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--skip", choices=["spark", "server", "onnx"], action="append", default=[])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    spark, results = start("spark_hvd-bench-serving", __name__)
    import mlflow

    from spark_hvd.estimators import TorchModel

    tracking = f"file://{tempfile.mkdtemp(prefix='serving-')}/mlruns"  # new: the store makes its default experiment
    os.environ["MLFLOW_TRACKING_URI"] = tracking
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow 3.x refuses a file store without it
    mlflow.set_tracking_uri(tracking)
    model = TorchModel(model=digits_mlp(), feature_cols=["features"], label_cols=["label"], batch_size=1024,
                       metadata={"classifier": "logits"})
    example = _rows_df(spark, 8)
    t0 = time.perf_counter()
    info = model.log_mlflow(input_example=example)
    results["log_mlflow_s"] = time.perf_counter() - t0
    results["mlflow"] = mlflow.__version__
    if "spark" not in args.skip:
        unchecked = model.log_mlflow(name="unchecked", input_example=example, check_input=False, log_network=False)
        results["spark"] = bench_spark(spark, model, info.model_uri, args.rows, args.repeats, unchecked.model_uri)
    if "server" not in args.skip:
        results["server"] = bench_server(info.model_uri, tracking, args.requests)
    if "onnx" not in args.skip:
        results["onnx"] = bench_onnx(model, args.rows, args.repeats)
    finish(results, args.out)
    spark.stop()
    return results


if __name__ == "__main__":
    main()
