"""Data-parallel training on Spark with ``spark_hvd.runner.run``, as a batch job.

    PYSPARK_PYTHON=.venv/bin/python .venv/bin/spark-submit --master 'local[2]' examples/spark_submit_train.py

Each rank (one Spark barrier task) holds its own shard of a synthetic linear-regression data set, computes the
gradient of the mean squared error on its shard, and the ranks average their gradients with
``spark_hvd.core.allreduce`` before every step, exactly what ``DistributedOptimizer`` does for a network. Rank 0
reports the loss per epoch (shown on the driver), and the driver checks the trained weights against the
least-squares solution computed on all the data in one process.
"""

from __future__ import annotations

import argparse
import logging
import sys

import numpy as np

FEATURES = 8
ROWS_PER_RANK = 4096


def make_shard(rank: int, seed: int = 7) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s rows of the data set (the same on every run)."""
    true_w = np.random.default_rng(seed).standard_normal(FEATURES + 1)
    rng = np.random.default_rng(seed + 1 + rank)
    x = rng.standard_normal((ROWS_PER_RANK, FEATURES))
    x = np.hstack([x, np.ones((ROWS_PER_RANK, 1))])  # bias column
    y = x @ true_w + 0.1 * rng.standard_normal(ROWS_PER_RANK)
    return x, y


def train(epochs: int, lr: float, batch_size: int) -> dict:
    """Runs on every rank: mini-batch SGD with gradients averaged across ranks."""
    import spark_hvd.core as hvd
    from spark_hvd.runner import report

    hvd.init()  # harmless: the runner has already joined this rank to the job
    x, y = make_shard(hvd.rank())
    w = np.zeros(FEATURES + 1)
    w = hvd.broadcast(w, root_rank=0)  # every rank starts from rank 0's weights
    rng = np.random.default_rng(hvd.rank())
    for epoch in range(epochs):
        order = rng.permutation(len(x))
        for start in range(0, len(x), batch_size):
            idx = order[start:start + batch_size]
            grad = 2.0 * x[idx].T @ (x[idx] @ w - y[idx]) / len(idx)
            grad = hvd.allreduce(grad)  # average over ranks
            w -= lr * grad
        loss = np.array([np.mean((x @ w - y) ** 2)])
        loss = hvd.allreduce(loss)
        if hvd.rank() == 0:
            report(epoch=epoch, loss=float(loss[0]))
        print(f"epoch {epoch} done, local loss {np.mean((x @ w - y) ** 2):.5f}")
    return {"rank": hvd.rank(), "size": hvd.size(), "weights": w}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-proc", type=int, default=None, help="ranks (default: spark.default.parallelism)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    from pyspark.sql import SparkSession

    from spark_hvd.runner import last_events, run

    spark = SparkSession.builder.appName("spark_hvd spark-submit example").getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    try:
        results = run(train, args=(args.epochs, args.lr, args.batch_size), num_proc=args.num_proc)
    finally:
        spark.stop()

    size = results[0]["size"]
    weights = [r["weights"] for r in results]
    same = all(np.allclose(w, weights[0]) for w in weights)
    shards = [make_shard(r) for r in range(size)]
    x_all = np.vstack([s[0] for s in shards])
    y_all = np.concatenate([s[1] for s in shards])
    exact = np.linalg.lstsq(x_all, y_all, rcond=None)[0]
    error = float(np.max(np.abs(weights[0] - exact)))
    losses = [e.metrics["loss"] for e in last_events() if e.rank == 0]
    print(f"trained on {size} ranks: loss per epoch {[round(v, 5) for v in losses]}")
    print(f"weights identical on every rank: {same}; max |w - least squares| = {error:.4f}")
    ok = same and error < 0.05 and len(losses) == args.epochs
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
