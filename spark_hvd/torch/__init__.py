"""The Horovod torch API over the spark_hvd core: ``import spark_hvd.torch as hvd``.

Example::

    import spark_hvd.torch as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size()),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
"""

from __future__ import annotations

from spark_hvd import _process_api
from spark_hvd._process_api import *  # noqa: F403 - the process API every binding exports (_process_api.py)
from spark_hvd.torch import elastic  # hvd.elastic.run / TorchState / ElasticSampler
from spark_hvd.torch.build import cuda_built, nccl_built, rocm_built
from spark_hvd.torch.collectives import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from spark_hvd.torch.compression import Compression
from spark_hvd.torch.functions import broadcast_optimizer_state, broadcast_parameters
from spark_hvd.torch.mpi_ops import (
    Handle,
    allgather_async,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    init,
    poll,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from spark_hvd.torch.optimizer import DistributedOptimizer
from spark_hvd.torch.sync_batch_norm import SyncBatchNorm

__all__ = [
    *_process_api.__all__,
    "Compression", "DistributedOptimizer", "Handle", "SyncBatchNorm", "allgather", "allgather_async", "allreduce",
    "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "broadcast_optimizer_state", "broadcast_parameters", "cuda_built",
    "elastic", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async",
    "init", "nccl_built", "poll", "reducescatter", "reducescatter_async", "rocm_built", "sparse_allreduce_async",
    "synchronize",
]
