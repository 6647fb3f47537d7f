"""Horovod's MXNet API over the spark_hvd core: ``import spark_hvd.mxnet as hvd``.

Example (Gluon)::

    import mxnet as mx
    import spark_hvd.mxnet as hvd

    hvd.init()
    net = mx.gluon.nn.Dense(10)
    net.initialize()
    params = net.collect_params()
    hvd.broadcast_parameters(params, root_rank=0)            # deferred parameters: when they are initialised
    trainer = hvd.DistributedTrainer(params, "sgd", {"learning_rate": 0.1 * hvd.size()})
    for x, y in batches:
        with mx.autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(x.shape[0])                             # gradients averaged across the ranks

MXNet 1.9.1 (its last release; MXNet is retired to the Apache Attic) on CPU; see docs/mxnet.md. Importing this
module imports mxnet; ``import spark_hvd`` does not.
"""

from __future__ import annotations

from spark_hvd import _process_api
from spark_hvd._process_api import *  # noqa: F403 - the process API every binding exports (_process_api.py)
from spark_hvd.mxnet.compression import Compression
from spark_hvd.mxnet.functions import broadcast_parameters
from spark_hvd.mxnet.mpi_ops import (
    CollectiveArgumentError,
    allgather,
    allreduce,
    allreduce_,
    alltoall,
    broadcast,
    broadcast_,
    cuda_built,
    grouped_allgather,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_reducescatter,
    init,
    nccl_built,
    reducescatter,
    rocm_built,
)
from spark_hvd.mxnet.optimizer import DistributedOptimizer, DistributedTrainer

__all__ = [
    *_process_api.__all__,
    "allgather", "allreduce", "allreduce_", "alltoall", "broadcast", "broadcast_", "broadcast_parameters",
    "CollectiveArgumentError", "Compression", "cuda_built", "DistributedOptimizer", "DistributedTrainer",
    "grouped_allgather", "grouped_allreduce", "grouped_allreduce_", "grouped_reducescatter", "init", "nccl_built",
    "reducescatter", "rocm_built",
]
