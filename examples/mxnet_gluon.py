"""A Gluon training loop made data-parallel with Horovod's MXNet API (``spark_hvd.mxnet``).

    spark-hvd-run -np 2 python examples/mxnet_gluon.py --epochs 3

or on Spark, each rank in a task of one barrier stage::

    from spark_hvd.runner import run
    run(main, args=(["--epochs", "3"],), num_proc=2)      # or run("examples/mxnet_gluon.py", args=[...])

Each rank trains on its own shard of a synthetic 3-class problem (three Gaussian blobs in 10 dimensions, the same
on every rank); ``broadcast_parameters`` makes every rank start from rank 0's weights and ``DistributedTrainer``
averages the gradients. A Horovod script changes ``import horovod.mxnet as hvd`` to ``import spark_hvd.mxnet as
hvd``. MXNet 1.9.1 needs numpy < 1.24 (docs/mxnet.md).
"""

from __future__ import annotations

import argparse
import sys
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning)  # MXNet 1.9 reads numpy aliases numpy deprecated

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402

import spark_hvd.mxnet as hvd  # noqa: E402


def blobs(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` points of three Gaussian blobs in 10 dimensions and their labels (the same for every rank)."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(0, 2.0, (3, 10))
    y = rng.integers(0, 3, n)
    x = centers[y] + rng.normal(0, 1.5, (n, 10))
    return x.astype(np.float32), y.astype(np.float32)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description="a Gluon loop, data-parallel with spark_hvd.mxnet")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="rows per batch on each process")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args(argv)

    hvd.init()
    mx.random.seed(hvd.rank())  # different initial weights: broadcast_parameters makes them equal

    x, y = blobs(3000)
    shard_x, shard_y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    data = mx.gluon.data.DataLoader(mx.gluon.data.ArrayDataset(shard_x, shard_y), batch_size=args.batch_size,
                                    shuffle=True, last_batch="discard")

    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(32, activation="relu"), mx.gluon.nn.Dense(3))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    params = net.collect_params()
    hvd.broadcast_parameters(params, root_rank=0)  # deferred shapes: applied at the first forward pass
    trainer = hvd.DistributedTrainer(params, "sgd", {"learning_rate": args.lr * hvd.size(), "momentum": 0.9})
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()

    for epoch in range(args.epochs):
        total, batches = 0.0, 0
        for xb, yb in data:
            with mx.autograd.record():
                loss = loss_fn(net(xb), yb)
            loss.backward()
            trainer.step(xb.shape[0])
            total += float(loss.mean().asscalar())
            batches += 1
        mean = hvd.allreduce(mx.nd.array([total / max(batches, 1)]), name="epoch_loss").asscalar()
        if hvd.rank() == 0:
            print(f"epoch {epoch} loss {mean:.4f}", flush=True)

    accuracy = float((net(mx.nd.array(x)).argmax(axis=1).asnumpy() == y).mean())
    checksum = mx.nd.array([sum(float(p.data().sum().asscalar()) for p in params.values())], dtype="float64")
    sums = hvd.allgather(checksum).asnumpy()
    same = bool(np.allclose(sums, sums[0], rtol=1e-6))
    if hvd.rank() == 0:
        print(f"accuracy {accuracy:.4f}; ranks={hvd.size()} weights identical on every rank: {same}", flush=True)
    return {"accuracy": accuracy, "same": float(same), "rank": float(hvd.rank())}


if __name__ == "__main__":
    result = main()
    hvd.shutdown()
    sys.exit(0 if result["same"] else 1)
