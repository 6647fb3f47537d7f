"""KerasEstimator / KerasModel against their peers, all in one invocation on one local[2] Spark session.

The Keras counterpart of ``benchmarks/estimator.py`` (same data, same model shape: 32 -> 64 -> 64 -> 1 MLP).

transform: rows/s of ``KerasModel.transform`` (mapInArrow, batches of 1024) on a cached DataFrame, against
  ``model.predict(x, batch_size=1024)`` on the same rows as an in-memory numpy array in the driver (TensorFlow's
  default threads: all cores). Target: transform >= 50% of it. Also Spark's own Arrow round trip with no model
  (``arrow_floor_run``, timed alternately with the transform), the ceiling any batched Python transform can
  approach on this DataFrame, and a row-at-a-time ``rdd.mapPartitions`` calling the model once per row.
fit: wall time of ``KerasEstimator.fit`` (num_proc=2) against the same ``model.fit`` on in-memory arrays in 2
  processes under ``spark-hvd-run`` (the estimator's prepared Parquet read with pyarrow, rank-strided shards,
  DistributedOptimizer + BroadcastGlobalVariablesCallback + MetricAverageCallback, same model, optimizer, batch
  size, epochs and steps per epoch). Target: fit <= 1.25x + 15 s. The plain run's wall time includes importing
  TensorFlow in both ranks; a warm estimator fit reuses Spark's Python workers, where it is imported already.

    .venv/bin/python benchmarks/estimator_keras.py [--rows 100000] [--row-at-a-time-rows 2000] [--fit-rows 20000]
        [--epochs 2] [--batch 128]
        [--repeats 2] [--out results.json]

Fits are timed warm (a first fit prepares the data and starts the Python workers), each item the median of
``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared helpers, also under python -m / import
from _timing import (  # noqa: E402
    WIDTH,
    arrow_floor_run,
    features_df,
    finish,
    fit_vs_plain,
    median_time,
    paired_median_times,
    start,
)

log = logging.getLogger("benchmarks.estimator_keras")


def _model(seed: int = 0):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input(shape=(WIDTH,)), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)])


def bench_transform(spark, rows: int, repeats: int, slow_rows: int = 2000) -> dict:
    import numpy as np

    from spark_hvd.estimators import KerasModel

    cores = spark.sparkContext.defaultParallelism
    df = features_df(spark, rows, seed=1).repartition(cores).cache()
    df.count()
    model = _model()
    km = KerasModel(model=model, feature_cols=["features"], label_cols=["y"], batch_size=1024)

    def run_transform():
        km.transform(df).write.format("noop").mode("overwrite").save()

    t_first = median_time(run_transform, 1)
    run_floor = arrow_floor_run(df, "y__output")
    run_floor()  # warm
    t_transform, t_floor = paired_median_times(run_transform, run_floor, repeats)
    x = np.asarray(df.select("features").toPandas()["features"].tolist(), dtype=np.float32)
    model.predict(x[:2048], batch_size=1024, verbose=0)  # warm: trace the predict function

    t_memory = median_time(lambda: model.predict(x, batch_size=1024, verbose=0), repeats)
    small = df.limit(slow_rows).repartition(cores).cache()
    small.count()

    def row_at_a_time(it):
        import numpy as np_

        for row in it:
            out = model(np_.asarray([row.features], dtype=np_.float32), training=False)
            yield (*row, float(np_.asarray(out)[0, 0]))

    from pyspark.sql.types import DoubleType, StructField, StructType

    schema = StructType(list(small.schema.fields) + [StructField("y__output", DoubleType())])

    def run_rows():
        spark.createDataFrame(small.rdd.mapPartitions(row_at_a_time), schema).write.format("noop") \
            .mode("overwrite").save()

    run_rows()  # warm: TensorFlow imported in the workers
    t_rows = median_time(run_rows, repeats)
    res = {"rows": rows, "transform_rows_per_s": rows / t_transform, "transform_first_call_s": t_first,
           "in_memory_predict_rows_per_s": rows / t_memory, "arrow_floor_rows_per_s": rows / t_floor,
           "row_at_a_time_rows": slow_rows, "row_at_a_time_rows_per_s": slow_rows / t_rows}
    res["transform_vs_in_memory"] = res["transform_rows_per_s"] / res["in_memory_predict_rows_per_s"]
    res["transform_vs_arrow_floor"] = t_floor / t_transform
    res["transform_vs_row_at_a_time"] = res["transform_rows_per_s"] / res["row_at_a_time_rows_per_s"]
    df.unpersist()
    small.unpersist()
    return res


_PLAIN_FIT = r'''
import json, math, os, sys, time
t_start = time.perf_counter()
n = max(1, (os.cpu_count() or 1) // int(os.environ.get("SPARK_HVD_LOCAL_SIZE", "1")))
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", str(n))
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "2")
import numpy as np, pyarrow.dataset as ds, keras
import spark_hvd.keras as hvd
sys.path.insert(0, {bench_dir!r})
from estimator_keras import _model
from _timing import load_prepared
hvd.init()
t0 = time.perf_counter()
feats, y = load_prepared({path!r})
rank, size, bs, epochs = hvd.rank(), hvd.size(), {batch}, {epochs}
x_r, y_r = feats[rank::size], y[rank::size]
steps = math.ceil(math.ceil(len(feats) / size) / bs)
t_load = time.perf_counter() - t0
model = _model()
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3)), loss="mse", jit_compile=False)
t1 = time.perf_counter()
h = model.fit(x_r, y_r, batch_size=bs, epochs=epochs, steps_per_epoch=min(steps, math.ceil(len(x_r) / bs)),
              shuffle=True, verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                                  hvd.callbacks.MetricAverageCallback()])
t_train = time.perf_counter() - t1
if rank == 0:
    print("RESULT", json.dumps({{"import_s": t0 - t_start, "load_s": t_load, "train_s": t_train,
                                 "loss": h.history["loss"]}}), flush=True)
'''


def bench_fit(spark, rows: int, epochs: int, batch: int, repeats: int) -> dict:
    import keras

    from spark_hvd.estimators import KerasEstimator

    def estimator(store):
        return KerasEstimator(num_proc=2, store=store, model=_model(), optimizer=keras.optimizers.Adam(1e-3),
                              loss="mse", feature_cols=["features"], label_cols=["y"], batch_size=batch,
                              epochs=epochs, shuffle=True, random_seed=0, partitions_per_process=4, verbose=0)

    res, _, df = fit_vs_plain(spark, estimator, _PLAIN_FIT, "plain_fit.py", rows, epochs, batch, repeats,
                              "bench_estimator_keras_")
    df.unpersist()
    return res


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--row-at-a-time-rows", type=int, default=2_000)
    parser.add_argument("--fit-rows", type=int, default=20_000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip", choices=["transform", "fit"], action="append", default=[])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    spark, results = start("bench-estimator-keras", __name__)
    if "transform" not in args.skip:
        results["transform"] = bench_transform(spark, args.rows, args.repeats, args.row_at_a_time_rows)
        log.info("transform: %s", json.dumps(results["transform"]))
    if "fit" not in args.skip:
        results["fit"] = bench_fit(spark, args.fit_rows, args.epochs, args.batch, args.repeats)
        log.info("fit: %s", json.dumps(results["fit"]))
    finish(results, args.out)
    spark.stop()
    return results


if __name__ == "__main__":
    main()
