"""What the benchmark scripts share: the data, the Spark session, how an item is timed (the median of repeated
wall-clock runs; variants interleaved in one invocation), the plain ``spark-hvd-run`` baseline and how results are
written.

The benchmark scripts import it as ``_timing`` (their directory is ``sys.path[0]`` when run as scripts). Everything
here runs in the driver; nothing of it is shipped to Spark's Python workers.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

WIDTH = 32  # features per row; the models of both benchmarks are 32 -> 64 -> 64 -> 1 MLPs

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall-clock seconds of ``repeats`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def features_df(spark: Any, rows: int, seed: int) -> Any:
    """``rows`` rows of ``features`` (WIDTH random floats) and ``y`` (the sum of sin(3 * feature)), made in Spark."""
    from pyspark.sql import functions as F

    cols = [F.rand(seed * 100 + i).cast("float") for i in range(WIDTH)]
    df = spark.range(rows).select(F.array(*cols).alias("features"))
    return df.withColumn("y", F.aggregate("features", F.lit(0.0).cast("double"),
                                          lambda acc, v: acc + F.sin(v * 3.0)).cast("double"))


def arrow_floor_run(df: Any, output: str) -> Callable[[], Any]:
    """Spark's own Arrow round trip on ``df``: a ``mapInArrow`` that passes the columns through and adds a zero
    ``output`` double column, written to the noop sink. No model: what any batched Python transform pays for moving
    the rows to Python and back, the ceiling a model transform can approach. Returns the call to time."""
    import numpy as np
    import pyarrow as pa

    names = list(df.columns)

    def identity(batches):
        for batch in batches:
            yield pa.RecordBatch.from_arrays([*batch.columns, pa.array(np.zeros(batch.num_rows))],
                                             names=[*names, output])

    schema = f"{df.schema.simpleString()[len('struct<'):-1]},{output}:double"
    return lambda: df.mapInArrow(identity, schema).write.format("noop").mode("overwrite").save()


def arrow_floor_rows_per_s(df: Any, output: str, repeats: int) -> float:
    """Rows/s of :func:`arrow_floor_run` (median of ``repeats``, after one warm-up run)."""
    run = arrow_floor_run(df, output)
    run()  # warm the Python workers
    return df.count() / median_time(run, repeats)


def paired_median_times(a: Callable[[], Any], b: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Median seconds of ``a`` and of ``b``, timed alternately (a, b, a, b, ...), so that a load that changes
    during the run weighs on both alike: their ratio is steadier than from two separate series."""
    ta, tb = [], []
    for _ in range(repeats):
        for fn, times in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def local_spark(app_name: str) -> Any:
    """The benchmarks' local[2] session (environment defaults set first, the benchmark directory on sys.path)."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if BENCH_DIR not in sys.path:
        sys.path.insert(0, BENCH_DIR)  # functions shipped to workers refer to the benchmark modules
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName(app_name).config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "4").config("spark.driver.memory", "4g")
             .config("spark.python.worker.reuse", "true").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def start(app_name: str, module_name: str) -> tuple[Any, dict]:
    """A benchmark's start: logging, the local[2] session, the benchmark module pickled by value (so Spark's workers
    need not import it), and the results' header (cpus, load average before)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    spark = local_spark(app_name)
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[module_name])
    return spark, {"cpus": os.cpu_count(), "load_before": os.getloadavg()}


def fit_vs_plain(spark: Any, make_estimator: Callable[[Any], Any], plain_template: str, script_name: str,
                 rows: int, epochs: int, batch: int, repeats: int, tmp_prefix: str) -> tuple[dict, str, Any]:
    """The fit measurement of both estimator benchmarks.

    ``make_estimator(store)`` builds the estimator; a first fit (timed, prepares the data and starts the Python
    workers), then the median of ``repeats`` warm fits, against ``repeats`` runs of ``plain_template`` under
    ``spark-hvd-run -np 2`` on the prepared Parquet (``time_plain_run``). Returns the results, the prepared training
    Parquet's path and the cached DataFrame (the caller unpersists it).
    """
    from spark_hvd.store import Store

    tmp = tempfile.mkdtemp(prefix=tmp_prefix)
    store = Store.create(os.path.join(tmp, "store"))
    df = features_df(spark, rows, seed=2).cache()
    df.count()
    t0 = time.perf_counter()
    model = make_estimator(store).fit(df)
    t_first = time.perf_counter() - t0
    losses = model.getHistory()["loss"]
    t_fit = median_time(lambda: make_estimator(store).fit(df), repeats)
    train_path = prepared_train_path(store)
    t_plain, plain = time_plain_run(plain_template, tmp, script_name, train_path, batch, epochs, repeats)
    res = {
        "fit_rows": rows, "epochs": epochs, "batch": batch,
        "fit_first_s (prepares data)": t_first, "fit_s": t_fit, "fit_loss_per_epoch": losses,
        "plain_spark_hvd_run_s": t_plain, "plain_detail": plain,
        "fit_vs_plain": t_fit / t_plain, "fit_minus_1.25x_plain_s": t_fit - 1.25 * t_plain,
    }
    return res, train_path, df


def prepared_train_path(store: Any) -> str:
    """Where the estimator's prepared training Parquet lies in ``store`` (the store's one dataset)."""
    from spark_hvd.data.metadata import DatasetInfo

    key = store.list_datasets()[0]
    return DatasetInfo.load(store, key).train_path(store)


def load_prepared(path: str) -> tuple[Any, Any]:
    """The prepared Parquet at ``path`` as float32 arrays (pyarrow): features ``(rows, WIDTH)``, y ``(rows,)``.

    Used by the plain ``spark-hvd-run`` scripts (their load time)."""
    import numpy as np
    import pyarrow.dataset as ds

    table = ds.dataset(path, format="parquet").to_table()
    feats = table.column("features").combine_chunks().flatten().to_numpy().reshape(len(table), -1).astype(np.float32)
    y = table.column("y").to_numpy().astype(np.float32)
    return feats, y


def time_plain_run(template: str, tmp: str, name: str, train_path: str, batch: int, epochs: int,
                   repeats: int) -> tuple[float, dict]:
    """Median seconds of ``spark-hvd-run -np 2`` on the script ``template`` (formatted with ``bench_dir``, ``path``,
    ``batch``, ``epochs`` and written to ``tmp/name``), and the JSON its rank 0 printed after ``RESULT``."""
    script = os.path.join(tmp, name)
    with open(script, "w") as f:
        f.write(template.format(bench_dir=BENCH_DIR, path=train_path, batch=batch, epochs=epochs))
    runner = os.path.join(os.path.dirname(sys.executable), "spark-hvd-run")
    detail: dict = {}

    def run_plain() -> None:
        out = subprocess.run([runner, "-np", "2", sys.executable, script], capture_output=True, text=True,
                             timeout=1200, check=True)
        for line in out.stdout.splitlines():
            if "RESULT" in line:
                detail.update(json.loads(line.split("RESULT", 1)[1]))

    return median_time(run_plain, repeats), detail


def interleaved(rounds: int, variants: Sequence[Any], run: Callable[[Any], dict],
                value: Callable[[dict], Iterable[float]]) -> tuple[dict[Any, list[dict]], dict[Any, float]]:
    """``run(variant)`` for every variant in turn, ``rounds`` times (a, b, a, b, ...: one invocation, so that both
    sides see the same machine load); each result is printed as a JSON line on stderr as it comes. Returns the
    results by variant and, by variant, the median of the numbers ``value(result)`` gives over all its results."""
    results: dict[Any, list[dict]] = {v: [] for v in variants}
    for _ in range(rounds):
        for variant in variants:
            result = run(variant)
            print(json.dumps(result, default=str), file=sys.stderr, flush=True)
            results[variant].append(result)
    medians = {v: statistics.median(x for r in rs for x in value(r)) for v, rs in results.items() if rs}
    return results, medians


def finish(results: dict, out: str | None) -> None:
    """Record the load average after the run, print the results as JSON and write them to ``out`` when given."""
    results["load_after"] = os.getloadavg()
    text = json.dumps(results, indent=2, default=str)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
