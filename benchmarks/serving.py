"""Serving a fitted stage four ways, against what each one should match (issue 42's targets), in one invocation.

- ``mlflow.pyfunc.spark_udf`` over the logged pyfunc vs ``TorchModel.transform``, rows/s on the same cached
  DataFrame, written to the noop sink (target: >= 0.8x), and ``transform`` vs Spark's Arrow round trip with no model
  (``_timing.arrow_floor_run``; target: >= 1.0x); ``transform`` of the classifier (its columns in numpy inside the
  Arrow function) vs the raw output plus the same columns as Spark SQL expressions (``add_classifier_columns``, how
  ``transform`` made them before), and ``spark_udf`` over the same pyfunc logged with ``check_input=False`` (MLflow
  then checks no input schema) and with the column schema (below). All are
  timed in turn (a, b, c, a, b, c, ...) so that a load that changes during the run weighs on all alike.
- MLflow's scoring server (``mlflow models serve``, loopback) answering a 64-row JSON batch vs the same pyfunc
  called in process on the same 64 rows: median latency of ``--requests`` each, in turn (target: <= 2x); a new
  connection per request (``urllib``) and one kept alive (``http.client``), the rows as ``dataframe_split`` and as
  the tensor format (``{"inputs": ...}``); and where the difference goes: MLflow's
  request handler in process (no HTTP), its JSON parse and its JSON writing alone.
- The pyfunc is logged as ``log_mlflow`` logs it (a numeric array column: an MLflow tensor signature), and beside it
  with MLflow's column schema (``Array(double)``, checked per row: the signature before; ``--skip columns`` leaves
  it out) and with ``check_input=False`` (no input schema), for ``spark_udf`` and the server's handler.
- The floor: ``FloorPyfunc``, a pyfunc with the stage's signature that answers the stage's columns from memory
  (no model runs), through ``spark_udf`` and a scoring server of its own, timed in turn with the rest: what MLflow
  and pyspark cost around any model with these outputs, so the stage against it is spark_hvd's share
  (``--skip floor`` leaves it out).
- Where a ``spark_udf`` batch of 10,000 rows goes, in the driver process: Arrow to pandas, MLflow's input check,
  the pyfunc's ``predict``, MLflow's conversion of the result, pyspark's pandas to Arrow (``--skip parts``).
- ONNX through onnxruntime on the CPU vs the torch module, rows/s on in-memory batches (target: >= 1.0x); only where
  onnxruntime imports (the ``export`` extra), else recorded as skipped.

The model is the digits MLP of ``examples/demo.py`` (64 -> 64 -> 10, a classifier: ``prediction`` and
``probability`` beside the logits), trained a few steps in process on sklearn's digits; the scored rows are
random 64-wide float arrays in [0, 1) made in Spark.

Run: ``python benchmarks/serving.py [--rows 200000] [--repeats 5] [--requests 100] [--udf-only] [--skip ...]
[--out results.json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import io
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

from _timing import arrow_floor_run, finish, start
from mlflow.pyfunc import PythonModel

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


def bench_spark(spark: Any, model: Any, uri: str, rows: int, repeats: int, others: dict[str, str],
                udf_only: bool = False) -> dict:
    """spark_udf over the logged pyfunc vs transform (both with the classifier's prediction and probability), and
    transform of the raw network output (one column, as the floor adds one) vs the Arrow round trip with no model,
    rows/s on the same DataFrame. ``others``: more pyfuncs to run ``spark_udf`` over, by item name (``unchecked``:
    logged with ``check_input=False``; ``columns``: with MLflow's column schema, an ``Array(double)`` column
    checked per row, the signature before the tensor one; ``floor``: :class:`FloorPyfunc`, what ``spark_udf``
    costs around a model that costs nothing). ``udf_only``: transform and the spark_udf items only."""
    import mlflow.pyfunc
    from pyspark.sql import functions as F  # noqa: N812

    from spark_hvd.estimators import TorchModel
    from spark_hvd.estimators.common.classifier import add_classifier_columns

    cores = spark.sparkContext.defaultParallelism
    df = _rows_df(spark, rows).repartition(cores).cache()
    df.count()
    result_type = "label__output array<float>, prediction double, probability array<double>"
    udfs = {name: mlflow.pyfunc.spark_udf(spark, u, env_manager="local", result_type=result_type)
            for name, u in {"spark_udf": uri, **{f"spark_udf_{k}": v for k, v in others.items()}}.items()}
    raw = TorchModel(model=model.getModel(), feature_cols=["features"], label_cols=["label"], batch_size=1024)

    def run_transform() -> None:
        model.transform(df).write.format("noop").mode("overwrite").save()

    def udf_run(udf: Any) -> Any:
        def run() -> None:
            df.withColumn("out", udf(F.struct("features"))).select("id", "features", "out.*") \
                .write.format("noop").mode("overwrite").save()
        return run

    def run_raw() -> None:
        raw.transform(df).write.format("noop").mode("overwrite").save()

    def run_sql_classifier() -> None:  # the classifier columns as before: Spark SQL expressions on the raw output
        add_classifier_columns(raw.transform(df), "label__output", "logits", "prediction", "probability") \
            .write.format("noop").mode("overwrite").save()

    fns = {"transform": run_transform, **{name: udf_run(udf) for name, udf in udfs.items()}}
    if not udf_only:
        fns.update({"transform_raw": run_raw, "transform_sql_classifier": run_sql_classifier,
                    "arrow_floor": arrow_floor_run(df, "label__output")})
    for fn in fns.values():
        fn()  # warm: Python workers, the model in each worker's cache
    t = _in_turn(fns, repeats)
    df.unpersist()
    rate = {k: rows / v for k, v in t.items()}
    return {"rows": rows, "partitions": cores, "repeats": repeats,
            **{f"{k}_rows_per_s": v for k, v in rate.items()},
            "spark_udf_vs_transform (>= 0.8)": rate["spark_udf"] / rate["transform"],
            **{f"{k}_vs_transform": rate[k] / rate["transform"] for k in udfs if k != "spark_udf"},
            **({"spark_udf_vs_floor": rate["spark_udf"] / rate["spark_udf_floor"]} if "floor" in others else {}),
            **({} if udf_only else {
                "transform_vs_sql_classifier": rate["transform"] / rate["transform_sql_classifier"],
                "transform_raw_vs_arrow_floor (>= 1.0)": rate["transform_raw"] / rate["arrow_floor"]})}


def bench_udf_parts(uri: str, rows: int, repeats: int) -> dict:
    """Where a ``spark_udf`` batch's time goes, in this process on one batch of ``rows`` rows (no Spark job): the
    Arrow batch to pandas as Spark hands a struct column over, MLflow's ``PyFuncModel.predict`` (its input check,
    then the pyfunc's ``predict``), the pyfunc's ``predict`` alone, MLflow's conversion of the result to the
    ``result_type`` (``_convert_struct_values``: a call per array cell) and pyspark's pandas-to-Arrow of that result
    (where this pyspark has ``PandasToArrowConversion``, 4.x). Median ms of ``repeats`` calls each, in turn."""
    import mlflow.pyfunc
    import numpy as np
    import pyarrow as pa
    from mlflow.models.utils import _enforce_schema
    from mlflow.pyfunc import _convert_struct_values
    from pyspark.sql.types import ArrayType, DoubleType, FloatType, StructField, StructType

    loaded = mlflow.pyfunc.load_model(uri)
    x = np.random.default_rng(5).random((rows, WIDTH), dtype=np.float32)
    column = pa.ListArray.from_arrays(pa.array(np.arange(0, rows * WIDTH + 1, WIDTH, dtype=np.int32)),
                                      pa.array(x.reshape(-1)))
    result_type = StructType([StructField("label__output", ArrayType(FloatType())),
                              StructField("prediction", DoubleType()),
                              StructField("probability", ArrayType(DoubleType()))])
    pdf = pa.table({"features": column}).to_pandas()
    result = loaded.predict(pdf)
    converted = _convert_struct_values(result, result_type)
    fns = {"arrow_to_pandas": lambda: pa.table({"features": column}).to_pandas(),
           "pyfunc_predict": lambda: loaded.predict(pdf),
           "input_check": lambda: _enforce_schema(pdf, loaded.metadata.get_input_schema()),
           "spark_hvd_predict": lambda: loaded.unwrap_python_model().predict(None, pdf),
           "mlflow_result_conversion": lambda: _convert_struct_values(result, result_type)}
    try:
        from pyspark.sql.conversion import PandasToArrowConversion

        outer = StructType([StructField("out", result_type)])
        fns["pandas_to_arrow"] = lambda: PandasToArrowConversion.convert([converted], outer, timezone="UTC")
    except ImportError:  # pyspark 3.5: another serializer
        pass
    t = _in_turn(fns, repeats)
    return {"rows": rows, "signature": str(loaded.metadata.get_input_schema()),
            **{f"{k}_ms": v * 1e3 for k, v in t.items()}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: bytes) -> dict:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


class FloorPyfunc(PythonModel):
    """A pyfunc that answers from memory: the stage pyfunc's columns for a digits classifier (``label__output``
    float32 arrays of 10, ``prediction`` doubles, ``probability`` double arrays of 10), made once at load as the
    stage's ``predict`` makes them (Arrow to pandas) and sliced to the request's length, no model run. ``spark_udf``
    and the scoring server over it cost what MLflow and pyspark cost around a model with these outputs (the input
    check, the result conversion, the JSON, HTTP), so the stage's pyfunc against it is spark_hvd's share."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def load_context(self, context: Any) -> None:
        """Build the answer (``rows`` rows, random values) in the stage's representation."""
        import numpy as np
        import pyarrow as pa

        rng = np.random.default_rng(11)
        logits = rng.standard_normal((self.rows, 10), dtype=np.float32)
        probability = np.exp(logits - logits.max(axis=1, keepdims=True)).astype(np.float64)
        probability /= probability.sum(axis=1, keepdims=True)
        self.answer = pa.table({
            "label__output": pa.FixedSizeListArray.from_arrays(pa.array(logits.reshape(-1)), 10),
            "prediction": pa.array(probability.argmax(axis=1).astype(np.float64)),
            "probability": pa.FixedSizeListArray.from_arrays(pa.array(probability.reshape(-1)), 10)}).to_pandas()

    def predict(self, context, model_input, params=None):  # noqa: ANN001, ANN201 - MLflow reads hints as a schema
        """The first ``len(model_input)`` rows of the answer."""
        n = len(next(iter(model_input.values()))) if isinstance(model_input, dict) else len(model_input)
        if n > len(self.answer):
            raise ValueError(f"FloorPyfunc holds {len(self.answer)} rows, asked for {n}")
        return self.answer.iloc[:n]


def log_floor(stage_uri: str, rows: int) -> str:
    """Log a :class:`FloorPyfunc` of ``rows`` rows with the stage's own signature (so MLflow checks its input and
    converts its result the same way); returns its model URI."""
    import mlflow

    signature = mlflow.models.get_model_info(stage_uri).signature
    with mlflow.start_run(nested=mlflow.active_run() is not None):
        info = _log_pyfunc(FloorPyfunc(rows), signature)
    return info.model_uri


def _log_pyfunc(python_model: Any, signature: Any) -> Any:
    import mlflow.pyfunc

    try:
        return mlflow.pyfunc.log_model(name="floor", python_model=python_model, signature=signature)
    except TypeError:  # MLflow 2.x: artifact_path, not name
        return mlflow.pyfunc.log_model(artifact_path="floor", python_model=python_model, signature=signature)


@contextlib.contextmanager
def _scoring_server(cli: str, uri: str, tracking: str) -> Iterator[str]:
    """``mlflow models serve`` of ``uri`` on a free loopback port, up (``/ping`` answers) within 180 s; yields its
    URL and stops it (its process group) on exit."""
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
            except OSError as e:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the scoring server of {uri} did not start (log: {log.name})") from e
                time.sleep(1)
        yield url
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
        log.close()


def bench_server(uri: str, tracking: str, requests: int, uri_columns: str | None = None,
                 uri_floor: str | None = None) -> dict:
    """The scoring server's latency for a 64-row JSON batch vs the pyfunc in process (median of ``requests``), and
    where the difference goes: MLflow's request handler called in process on the same body (``invocations``: JSON
    parsing, the cast to the signature, ``predict`` with its check, the answer's JSON; no HTTP), and its parse and
    its JSON writing alone. ``uri_columns``: the handler on the pyfunc logged with the column schema too.
    ``uri_floor``: a :class:`FloorPyfunc` served beside it (the same answer without a model)."""
    import mlflow.pyfunc
    import numpy as np
    import pandas as pd
    from mlflow.pyfunc import scoring_server

    cli = os.path.join(os.path.dirname(sys.executable), "mlflow")
    if not os.path.exists(cli):
        return {"skipped": f"no mlflow command beside {sys.executable}"}
    x = np.random.default_rng(3).random((64, WIDTH), dtype=np.float32)
    pdf = pd.DataFrame({"features": list(x)})
    body = json.dumps({"dataframe_split": {"columns": ["features"],
                                           "data": [[row.tolist()] for row in x]}}).encode()
    body_inputs = json.dumps({"inputs": {"features": x.tolist()}}).encode()  # the tensor request format
    loaded = mlflow.pyfunc.load_model(uri)
    schema = loaded.metadata.get_input_schema()
    columns = mlflow.pyfunc.load_model(uri_columns) if uri_columns else None

    def handler(model: Any) -> Any:
        answer = scoring_server.invocations(body, "application/json", model, model.metadata.get_input_schema())
        assert answer.status == 200, answer.response
        return answer

    def parse() -> Any:
        return scoring_server._parse_json_data(body, loaded.metadata, schema).data

    predictions = loaded.predict(parse())

    def write() -> None:
        scoring_server.predictions_to_json(predictions, io.StringIO())

    with contextlib.ExitStack() as servers:
        url = servers.enter_context(_scoring_server(cli, uri, tracking))
        floor_url = servers.enter_context(_scoring_server(cli, uri_floor, tracking)) if uri_floor else None
        answer = _post(f"{url}/invocations", body)["predictions"]
        direct = loaded.predict(pdf)
        np.testing.assert_allclose(np.array([r["label__output"] for r in answer]),
                                   np.stack(direct["label__output"].to_list()), rtol=1e-5, atol=1e-6)
        for _ in range(5):  # warm both
            _post(f"{url}/invocations", body)
            loaded.predict(pdf)
        connection = http.client.HTTPConnection(urllib.parse.urlsplit(url).hostname, urllib.parse.urlsplit(url).port,
                                                timeout=60)  # one connection, kept alive

        def keepalive() -> Any:
            connection.request("POST", "/invocations", body, {"Content-Type": "application/json"})
            return json.loads(connection.getresponse().read())

        fns = {"server": lambda: _post(f"{url}/invocations", body), "server_keepalive": keepalive,
               "server_inputs": lambda: _post(f"{url}/invocations", body_inputs),
               "in_process": lambda: loaded.predict(pdf),
               "handler": lambda: handler(loaded), "parse": parse, "write": write}
        if floor_url:
            _post(f"{floor_url}/invocations", body)
            fns["server_floor"] = lambda: _post(f"{floor_url}/invocations", body)
        if columns is not None:
            fns["handler_columns"] = lambda: handler(columns)
        t = _in_turn(fns, requests)
        connection.close()
    return {"batch_rows": 64, "requests": requests, "signature": "tensor" if schema.is_tensor_spec() else "columns",
            **{f"{k}_median_ms": v * 1e3 for k, v in t.items()},
            "server_vs_in_process (<= 2.0)": t["server"] / t["in_process"],
            "server_keepalive_vs_in_process": t["server_keepalive"] / t["in_process"],
            "server_inputs_vs_in_process": t["server_inputs"] / t["in_process"],
            "handler_vs_in_process": t["handler"] / t["in_process"],
            **({"server_vs_floor": t["server"] / t["server_floor"],
                "server_floor_vs_in_process": t["server_floor"] / t["in_process"]} if floor_url else {}),
            **({"handler_columns_vs_in_process": t["handler_columns"] / t["in_process"]} if columns else {})}


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
    parser.add_argument("--skip", choices=["spark", "server", "onnx", "columns", "parts", "floor"], action="append",
                        default=[], help="columns: leave out the pyfunc logged with the column schema (the per-row "
                                         "check); parts: the in-process split of a spark_udf batch")
    parser.add_argument("--udf-only", action="store_true",
                        help="time transform and the spark_udf items only (not the raw output, the SQL classifier "
                             "columns, the Arrow floor)")
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
    logged = mlflow.models.get_model_info(info.model_uri).signature
    results["signature"] = str(logged.inputs)
    uri_columns = None
    if "columns" not in args.skip:  # the signature log_mlflow gave before the tensor one: MLflow's column schema
        from mlflow.models import ModelSignature, infer_signature

        frame = example.selectExpr("transform(features, x -> cast(x as double)) as features").toPandas()
        signature = ModelSignature(inputs=infer_signature(frame).inputs, outputs=logged.outputs)
        uri_columns = model.log_mlflow(name="columns", input_example=example, log_network=False,
                                       signature=signature).model_uri
    uri_floor = None if "floor" in args.skip else log_floor(info.model_uri, 20_000)
    if "spark" not in args.skip:
        others = {"unchecked": model.log_mlflow(name="unchecked", input_example=example, check_input=False,
                                                log_network=False).model_uri}
        others.update({k: v for k, v in {"columns": uri_columns, "floor": uri_floor}.items() if v})
        results["spark"] = bench_spark(spark, model, info.model_uri, args.rows, args.repeats, others, args.udf_only)
    if "parts" not in args.skip:
        results["udf_parts"] = {"tensor": bench_udf_parts(info.model_uri, 10_000, args.repeats)}
        if uri_columns:
            results["udf_parts"]["columns"] = bench_udf_parts(uri_columns, 10_000, args.repeats)
    if "server" not in args.skip:
        results["server"] = bench_server(info.model_uri, tracking, args.requests, uri_columns, uri_floor)
    if "onnx" not in args.skip:
        results["onnx"] = bench_onnx(model, args.rows, args.repeats)
    finish(results, args.out)
    spark.stop()
    return results


if __name__ == "__main__":
    main()
