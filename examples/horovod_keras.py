"""The Horovod-style Keras 3 API without Spark: ``model.fit`` on each rank's share of sklearn's digits.

    spark-hvd-run -np 2 python examples/horovod_keras.py --epochs 5

A Horovod script changes ``import horovod.tensorflow.keras as hvd`` to ``import spark_hvd.keras as hvd``.
Keras 3 with the TensorFlow backend.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import spark_hvd.keras as hvd  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Horovod-style data-parallel training with spark_hvd.keras")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="rows per batch on each process")
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate (not scaled by the number of ranks)")
    args = parser.parse_args(argv)

    hvd.init()
    keras.utils.set_random_seed(hvd.rank())  # different initial weights: the broadcast callback makes them equal

    digits = load_digits()
    x, y = (digits.data / 16.0).astype("float32"), digits.target.astype("int64")
    order = np.random.default_rng(0).permutation(len(x))
    val_idx, train_idx = order[:300], order[300:]
    steps = len(train_idx) // hvd.size() // args.batch_size  # the same number of steps on every rank
    shard = train_idx[hvd.rank()::hvd.size()][:steps * args.batch_size]

    model = keras.Sequential([keras.Input(shape=(64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(learning_rate=args.lr)),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),  # rank 0's initial weights everywhere
        hvd.callbacks.MetricAverageCallback(),  # epoch metrics averaged over ranks
    ]
    history = model.fit(x[shard], y[shard], batch_size=args.batch_size, epochs=args.epochs, shuffle=True,
                        validation_data=(x[val_idx], y[val_idx]), callbacks=callbacks,
                        verbose=2 if hvd.rank() == 0 else 0)

    checksum = np.array([sum(float(np.sum(w)) for w in model.get_weights())], dtype=np.float64)
    sums = np.asarray(hvd.allgather(checksum))
    same = bool(np.allclose(sums, sums[0], rtol=1e-6))
    if hvd.rank() == 0:
        print(f"final val_accuracy {history.history['val_accuracy'][-1]:.4f}; ranks={hvd.size()} weights identical "
              f"on every rank: {same}", flush=True)
    hvd.shutdown()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
