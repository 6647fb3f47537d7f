"""CrossValidator over TorchEstimator(num_proc=2) on local[4]: parallelism=2 against parallelism=1.

Issue 44's target: ``CrossValidator(numFolds=3, 4 grid points, parallelism=2)`` completes in <= 0.8x the time of
``parallelism=1`` (small data: launch and preparation dominate), with the same ``bestModel`` params. Also counted:
the prepared datasets the store holds afterwards (one per fold and one for the final fit on the whole DataFrame:
the grid points of a fold share theirs).

    PYTHONPATH=. python benchmarks/model_selection.py [--parallelism 1,2] [--repeats 1] [--json out.json]

Runs interleaved in one invocation (p=1, p=2, p=1, p=2 ... with --repeats), each with a fresh store.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time

import numpy as np
from _timing import finish, interleaved


def _data(spark, rows: int = 600):
    rng = np.random.default_rng(5)
    centers = np.array([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.5]])
    y = rng.integers(0, 3, rows)
    x = centers[y] + 0.8 * rng.standard_normal((rows, 2))
    return spark.createDataFrame([(x[i].tolist(), int(y[i])) for i in range(rows)], "xy array<float>, label int")


def run_once(spark, df, parallelism: int, folds: int = 3) -> dict:
    import torch
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    from spark_hvd.estimators import TorchEstimator
    from spark_hvd.store import Store

    with tempfile.TemporaryDirectory(prefix="spark_hvd_ms_") as tmp:
        store = Store.create(os.path.join(tmp, "store"))
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(2, 3))
        est = TorchEstimator(num_proc=2, store=store, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                             loss="cross_entropy", feature_cols=["xy"], label_cols=["label"], batch_size=16,
                             epochs=1, random_seed=1, partitions_per_process=1, verbose=0)
        grid = (ParamGridBuilder().addGrid(est.batch_size, [8, 64]).addGrid(est.random_seed, [1, 2]).build())
        cv = CrossValidator(estimator=est, estimatorParamMaps=grid, numFolds=folds, seed=7, parallelism=parallelism,
                            evaluator=MulticlassClassificationEvaluator(labelCol="label", metricName="accuracy"))
        t0 = time.perf_counter()
        model = cv.fit(df)
        seconds = time.perf_counter() - t0
        best = int(np.argmax(model.avgMetrics))
        datasets = store.list_datasets()
    return {"parallelism": parallelism, "seconds": round(seconds, 1), "grid_points": len(grid), "folds": folds,
            "best_index": best, "best_params": {p.name: v for p, v in grid[best].items()},
            "avg_metrics": [round(m, 4) for m in model.avgMetrics], "datasets_in_store": len(datasets)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parallelism", default="1,2")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[4]").config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "4").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    df = _data(spark).cache()
    df.count()
    variants = [int(x) for x in args.parallelism.split(",")]
    by_p, medians = interleaved(args.repeats, variants, lambda p: run_once(spark, df, p), lambda r: [r["seconds"]])
    results = [r for rs in by_p.values() for r in rs]
    summary = {"runs": results, "median_seconds": medians, "cpus": os.cpu_count(), "load_1min": os.getloadavg()[0]}
    if 1 in medians and 2 in medians:
        summary["ratio_p2_over_p1"] = round(medians[2] / medians[1], 3)
        summary["same_best"] = len({json.dumps(r["best_params"], sort_keys=True) for r in results}) == 1
    finish(summary, args.json)

if __name__ == "__main__":
    main()
