"""``make demo``: train a TorchEstimator and a KerasEstimator on Spark, two processes each, in a few minutes.

What it does, on an embedded local Spark (``local[2]``, nothing to set up):

1. loads scikit-learn's bundled digits (1797 images of 8x8 pixels, no download) into a DataFrame of 64 pixel
   columns and a label, and holds out 20% of the rows;
2. fits ``Pipeline(stages=[VectorAssembler, TorchEstimator(num_proc=2, ...)])`` and prints the per-epoch history;
3. transforms the held-out rows, measures their accuracy, saves the fitted Pipeline, loads it back and checks that
   the reloaded one predicts the same;
4. does the same with a ``KerasEstimator`` (skipped, with a message, where this checkout has none yet);
5. prints one summary line.

Run it with ``make demo`` or ``.venv/bin/python examples/demo.py [--epochs N] [--keep DIR]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

# Spark's workers must run this interpreter, and bind to loopback (no network needed). Set before pyspark starts.
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

NUM_PROC = 2
PIXELS = [f"p{i}" for i in range(64)]
_T0 = time.monotonic()


def say(message: str) -> None:
    """One progress line with the time since the start (the demo's own display; ranks print per-epoch lines)."""
    print(f"[demo {time.monotonic() - _T0:6.1f}s] {message}", flush=True)


def start_spark():
    """An embedded ``local[2]`` SparkSession: two task slots, so two training processes."""
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master(f"local[{NUM_PROC}]")
        .appName("spark_hvd-demo")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")  # the estimators print their own progress
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def digits_frames(spark):
    """sklearn's digits as a DataFrame (pixels scaled to [0, 1], integer label), split 80/20 for training/holdout."""
    import pandas as pd
    from sklearn.datasets import load_digits

    digits = load_digits()
    pdf = pd.DataFrame(digits.data / 16.0, columns=PIXELS)
    pdf["label"] = digits.target.astype("int64")
    df = spark.createDataFrame(pdf)
    train, holdout = df.randomSplit([0.8, 0.2], seed=7)
    return train.cache(), holdout.cache()


def print_history(history: dict[str, list[float]]) -> None:
    """The per-epoch history of ``getHistory()`` as a small table."""
    keys = sorted(history)
    print("    epoch  " + "  ".join(f"{k:>12}" for k in keys))
    for epoch in range(max(len(v) for v in history.values())):
        print(f"    {epoch:5d}  " + "  ".join(f"{history[k][epoch]:12.4f}" for k in keys))


def holdout_accuracy(predictions, output_col: str) -> float:
    """Share of held-out rows whose arg-max output equals the label (computed by Spark, no collect of the rows)."""
    from pyspark.sql import functions as F

    pred = F.expr(f"array_position({output_col}, array_max({output_col})) - 1")
    row = predictions.select(F.avg((pred == F.col("label")).cast("double")).alias("acc")).first()
    return float(row["acc"])


def check_roundtrip(fitted, holdout, path: str, output_col: str) -> float:
    """Save the fitted Pipeline, load it back, and return the largest difference between the two predictions."""
    import numpy as np
    from pyspark.ml import PipelineModel

    fitted.write().overwrite().save(path)
    reloaded = PipelineModel.load(path)
    before = fitted.transform(holdout).orderBy("id").select(output_col).toPandas()[output_col]
    after = reloaded.transform(holdout).orderBy("id").select(output_col).toPandas()[output_col]
    return float(np.max(np.abs(np.stack(before.to_list()) - np.stack(after.to_list()))))


def run_torch(train, holdout, workdir: str, epochs: int) -> dict:
    """Pipeline(VectorAssembler, TorchEstimator): fit, history, holdout accuracy, save/load."""
    import torch
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import VectorAssembler

    from spark_hvd.estimators import TorchEstimator
    from spark_hvd.store import Store

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    estimator = TorchEstimator(
        num_proc=NUM_PROC,
        store=Store.create(os.path.join(workdir, "store")),
        model=net,
        optimizer=torch.optim.Adam(net.parameters(), lr=1e-2),
        loss="cross_entropy",
        metrics=["accuracy"],
        feature_cols=["features"],
        label_cols=["label"],
        batch_size=32,
        epochs=epochs,
        validation=0.1,
        random_seed=0,
        partitions_per_process=2,  # a tiny dataset: few Parquet files
    )
    pipeline = Pipeline(stages=[VectorAssembler(inputCols=PIXELS, outputCol="features"), estimator])
    say(f"torch: fitting Pipeline(VectorAssembler, TorchEstimator(num_proc={NUM_PROC}, epochs={epochs}))")
    start = time.monotonic()
    fitted = pipeline.fit(train)
    fit_s = time.monotonic() - start
    history = fitted.stages[-1].getHistory()
    say(f"torch: fitted in {fit_s:.1f}s; history (averaged over the {NUM_PROC} ranks):")
    print_history(history)
    predictions = fitted.transform(holdout)
    acc = holdout_accuracy(predictions, "label__output")
    say(f"torch: holdout accuracy {acc:.3f} on {holdout.count()} rows")
    diff = check_roundtrip(fitted, holdout, os.path.join(workdir, "torch_pipeline"), "label__output")
    say(f"torch: saved and reloaded the Pipeline; largest prediction difference {diff:.2g}")
    return {"val_accuracy": history["val_accuracy"][-1], "holdout_accuracy": acc, "fit_s": fit_s, "diff": diff}


def run_keras(train, holdout, workdir: str, epochs: int) -> dict | None:
    """Pipeline(VectorAssembler, KerasEstimator): the same steps; None where KerasEstimator is not there yet."""
    try:
        from spark_hvd.estimators import KerasEstimator
    except (ImportError, AttributeError) as exc:
        say(f"keras: SKIPPED: spark_hvd.estimators.KerasEstimator is not there yet ({type(exc).__name__}: {exc})")
        return None
    import keras
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import VectorAssembler

    from spark_hvd.store import Store

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input(shape=(64,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    estimator = KerasEstimator(
        num_proc=NUM_PROC,
        store=Store.create(os.path.join(workdir, "store")),  # same store: the prepared data is reused
        model=model,
        optimizer=keras.optimizers.Adam(learning_rate=1e-2),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        feature_cols=["features"],
        label_cols=["label"],
        batch_size=32,
        epochs=epochs,
        validation=0.1,
        random_seed=0,
        partitions_per_process=2,
    )
    pipeline = Pipeline(stages=[VectorAssembler(inputCols=PIXELS, outputCol="features"), estimator])
    say(f"keras: fitting Pipeline(VectorAssembler, KerasEstimator(num_proc={NUM_PROC}, epochs={epochs}))")
    start = time.monotonic()
    fitted = pipeline.fit(train)
    fit_s = time.monotonic() - start
    history = fitted.stages[-1].getHistory()
    say(f"keras: fitted in {fit_s:.1f}s; history (averaged over the {NUM_PROC} ranks):")
    print_history(history)
    predictions = fitted.transform(holdout)
    acc = holdout_accuracy(predictions, "label__output")
    say(f"keras: holdout accuracy {acc:.3f} on {holdout.count()} rows")
    diff = check_roundtrip(fitted, holdout, os.path.join(workdir, "keras_pipeline"), "label__output")
    say(f"keras: saved and reloaded the Pipeline; largest prediction difference {diff:.2g}")
    return {"val_accuracy": history["val_accuracy"][-1], "holdout_accuracy": acc, "fit_s": fit_s, "diff": diff}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4, help="epochs of each fit (default 4)")
    parser.add_argument("--keep", metavar="DIR", default=None,
                        help="keep the store and the saved Pipelines in DIR (default: a temporary directory)")
    parser.add_argument("--skip-keras", action="store_true", help="run the Torch part only")
    args = parser.parse_args(argv)

    workdir = args.keep or tempfile.mkdtemp(prefix="spark_hvd_demo_")
    os.makedirs(workdir, exist_ok=True)
    say(f"starting an embedded Spark (local[{NUM_PROC}]); files under {workdir}")
    spark = start_spark()
    try:
        from pyspark.sql import functions as F

        train, holdout = digits_frames(spark)
        holdout = holdout.withColumn("id", F.monotonically_increasing_id())
        say(f"digits: {train.count()} training rows, {holdout.count()} held out; 64 pixel columns + label")
        torch_result = run_torch(train, holdout, workdir, args.epochs)
        keras_result = None if args.skip_keras else run_keras(train, holdout, workdir, args.epochs)
    finally:
        spark.stop()
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)

    parts = [f"torch: val_accuracy {torch_result['val_accuracy']:.3f}, holdout {torch_result['holdout_accuracy']:.3f}, "
             f"fit {torch_result['fit_s']:.0f}s"]
    if keras_result is not None:
        parts.append(f"keras: val_accuracy {keras_result['val_accuracy']:.3f}, "
                     f"holdout {keras_result['holdout_accuracy']:.3f}, fit {keras_result['fit_s']:.0f}s")
    else:
        parts.append("keras: skipped" + (" (--skip-keras)" if args.skip_keras else " (KerasEstimator not there yet)"))
    roundtrips = [r["diff"] for r in (torch_result, keras_result) if r is not None]
    ok = all(d <= 1e-5 for d in roundtrips)
    parts.append("save/load " + ("ok" if ok else f"MISMATCH {max(roundtrips):.2g}"))
    print(f"SUMMARY spark_hvd demo: {' | '.join(parts)} | total {time.monotonic() - _T0:.0f}s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
