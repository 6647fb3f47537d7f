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

from spark_hvd._binding_common import HorovodInternalError
from spark_hvd.core.context import add_process_set, remove_process_set
from spark_hvd.core.errors import NotInitializedError
from spark_hvd.core.process_sets import ProcessSet, global_process_set
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
    Adasum,
    Average,
    Handle,
    Max,
    Min,
    Product,
    Sum,
    allgather_async,
    allgather_object,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    ccl_built,
    cross_rank,
    cross_size,
    ddl_built,
    gloo_built,
    gloo_enabled,
    grouped_allgather_async,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    poll,
    rank,
    reducescatter_async,
    shutdown,
    size,
    sparse_allreduce_async,
    start_timeline,
    stop_timeline,
    synchronize,
)
from spark_hvd.torch.optimizer import DistributedOptimizer
from spark_hvd.torch.sync_batch_norm import SyncBatchNorm

__all__ = [
    "Average", "Compression", "DistributedOptimizer", "Handle", "HorovodInternalError", "Max", "Min",
    "NotInitializedError", "ProcessSet", "Adasum", "Product", "Sum", "add_process_set", "global_process_set",
    "remove_process_set",
    "SyncBatchNorm",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "ccl_built",
    "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic", "gloo_built", "gloo_enabled", "grouped_allgather",
    "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_homogeneous",
    "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "poll", "rank", "reducescatter", "reducescatter_async", "rocm_built", "shutdown", "size",
    "sparse_allreduce_async", "start_timeline", "stop_timeline", "synchronize",
]
