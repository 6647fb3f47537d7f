"""A TensorFlow 2 custom training loop made data-parallel with Horovod's API (``spark_hvd.tensorflow``).

    spark-hvd-run -np 2 python examples/tensorflow_loop.py --steps 60

or on Spark, each rank in a task of one barrier stage::

    from spark_hvd.runner import run
    run(main, args=(["--steps", "60"],), num_proc=2)

Each rank trains on its own shard of sklearn's digits; ``DistributedGradientTape`` averages the gradients, and a
broadcast of rank 0's variables after the first step makes every rank start alike. A Horovod script changes
``import horovod.tensorflow as hvd`` to ``import spark_hvd.tensorflow as hvd``. docs/tensorflow.md shows the
single-process loop this was made from, and the diff.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import spark_hvd.tensorflow as hvd  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description="a TF2 custom loop, data-parallel with spark_hvd.tensorflow")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32, help="rows per batch on each process")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)

    hvd.init()
    tf.random.set_seed(hvd.rank())  # different initial weights: the broadcast below makes them equal

    digits = load_digits()
    x, y = (digits.data / 16.0).astype("float32"), digits.target.astype("int64")
    dataset = (tf.data.Dataset.from_tensor_slices((x, y)).shard(hvd.size(), hvd.rank())
               .repeat().shuffle(1000, seed=0).batch(args.batch_size))

    model = tf.keras.Sequential([tf.keras.Input(shape=(64,)), tf.keras.layers.Dense(64, activation="relu"),
                                 tf.keras.layers.Dense(10)])
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = tf.keras.optimizers.Adam(args.lr * hvd.size())

    @tf.function
    def training_step(images: tf.Tensor, labels: tf.Tensor, first_batch: bool) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss

    for step, (images, labels) in enumerate(dataset.take(args.steps)):
        loss = training_step(images, labels, step == 0)
        if step % 20 == 0 and hvd.rank() == 0:
            print(f"step {step} loss {float(loss):.4f}", flush=True)

    accuracy = float(np.mean(np.argmax(model(x).numpy(), axis=1) == y))
    checksum = tf.constant([sum(float(tf.reduce_sum(w)) for w in model.trainable_variables)], tf.float64)
    sums = hvd.allgather(checksum).numpy()
    same = bool(np.allclose(sums, sums[0], rtol=1e-6))
    if hvd.rank() == 0:
        print(f"accuracy {accuracy:.4f}; ranks={hvd.size()} weights identical on every rank: {same}", flush=True)
    return {"accuracy": accuracy, "same": float(same), "rank": float(hvd.rank())}


if __name__ == "__main__":
    result = main()
    hvd.shutdown()
    sys.exit(0 if result["same"] else 1)
