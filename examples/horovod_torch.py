"""The Horovod-style API without Spark: data-parallel training of a small torch MLP on sklearn's digits.

Run two local processes with the launcher (no Spark, no MPI needed)::

    spark-hvd-run -np 2 python examples/horovod_torch.py --epochs 5

and add a timeline of the collectives (a Chrome-trace JSON; open it at https://ui.perfetto.dev)::

    SPARK_HVD_TIMELINE=/tmp/timeline.json spark-hvd-run -np 2 python examples/horovod_torch.py

Run alone (``python examples/horovod_torch.py``) it is a job of one process. A Horovod script needs only its import
changed: ``import horovod.torch as hvd`` -> ``import spark_hvd.torch as hvd``.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
from sklearn.datasets import load_digits

import spark_hvd.torch as hvd


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Horovod-style data-parallel training with spark_hvd.torch")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="rows per batch on each process")
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate (not scaled by the number of ranks)")
    args = parser.parse_args(argv)

    hvd.init()  # rank and size come from spark-hvd-run's environment; size 1 without a launcher
    torch.set_num_threads(1)
    torch.manual_seed(hvd.rank())  # different initial weights on purpose: broadcast_parameters makes them equal

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    val_idx, train_idx = order[:300], order[300:]
    shard = train_idx[hvd.rank()::hvd.size()]  # each rank trains on its own share of the rows

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # every rank takes the same number of steps per epoch, so the allreduces stay in step
    steps = len(train_idx) // hvd.size() // args.batch_size
    for epoch in range(args.epochs):
        model.train()
        perm = shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(epoch))]
        total = torch.zeros(2, dtype=torch.float64)  # summed loss, rows
        for step in range(steps):
            idx = perm[step * args.batch_size:(step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()  # each gradient's allreduce starts as soon as it is ready
            optimizer.step()  # waits for the averaged gradients, then updates
            total += torch.tensor([loss.item() * len(idx), len(idx)], dtype=torch.float64)
        total = hvd.allreduce(total, op=hvd.Sum, name="train_loss")  # over all ranks
        model.eval()
        with torch.no_grad():
            correct = (model(x[val_idx]).argmax(1) == y[val_idx]).double().mean()
        if hvd.rank() == 0:
            print(f"epoch {epoch}: loss {float(total[0] / total[1]):.4f}  val_accuracy {float(correct):.4f}",
                  flush=True)

    # the ranks started from different weights and trained on different rows: they must still agree
    checksum = torch.tensor([sum(p.detach().double().sum().item() for p in model.parameters())])
    sums = hvd.allgather(checksum)
    same = bool(np.allclose(sums.numpy(), sums[0].item(), rtol=1e-6))
    if hvd.rank() == 0:
        print(f"ranks={hvd.size()} weights identical on every rank: {same}", flush=True)
    hvd.shutdown()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
