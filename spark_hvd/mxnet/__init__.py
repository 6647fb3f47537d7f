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

from spark_hvd._binding_common import (
    HorovodInternalError,
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from spark_hvd.core.errors import NotInitializedError
from spark_hvd.mxnet.compression import Compression
from spark_hvd.mxnet.functions import broadcast_parameters
from spark_hvd.mxnet.mpi_ops import (
    Adasum,
    Average,
    CollectiveArgumentError,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allgather_object,
    allreduce,
    allreduce_,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    broadcast_object,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    grouped_allgather,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_reducescatter,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    reducescatter,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from spark_hvd.mxnet.optimizer import DistributedOptimizer, DistributedTrainer

__all__ = [
    "Adasum", "add_process_set", "allgather", "allgather_object", "allreduce", "allreduce_", "alltoall", "Average",
    "barrier", "broadcast", "broadcast_", "broadcast_object", "broadcast_parameters", "ccl_built",
    "CollectiveArgumentError", "Compression", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "DistributedOptimizer", "DistributedTrainer", "global_process_set", "gloo_built", "gloo_enabled",
    "grouped_allgather", "grouped_allreduce", "grouped_allreduce_", "grouped_reducescatter", "HorovodInternalError",
    "init", "is_homogeneous", "is_initialized", "join", "local_rank", "local_size", "Max", "Min", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "NotInitializedError", "ProcessSet", "Product", "rank",
    "reducescatter", "remove_process_set", "rocm_built", "shutdown", "size", "start_timeline", "stop_timeline", "Sum",
]
