"""The ring core: collectives over numpy buffers, run by a background engine (no torch/tensorflow/pyspark here).

Process API (Horovod's, on numpy arrays)::

    import spark_hvd.core as core
    core.init()                                   # from the launcher's environment; size 1 when there is none
    h = core.allreduce_async(grad, name="w")      # in place, average by default
    core.synchronize(h)
    core.shutdown()

Rooms, each importing only those below it (``tests/test_layering.py``): the process API here (``context``,
``process_sets``, ``elastic``, ``state_stream``, ``torchrun``) over ``engine/`` over ``backends/`` over
``algorithms/`` over ``transport/`` over the ground floor here (``errors``, ``settings``, ``jobenv``, ``backend``,
``reduce``, ``compression``).
"""

from spark_hvd.core.backend import Adasum, Average, Backend, Max, Min, Product, ReduceOp, Rendezvous, Sum
from spark_hvd.core.context import (
    add_process_set,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_async,
    alltoall,
    alltoall_async,
    backend_name,
    barrier,
    broadcast,
    broadcast_async,
    broadcast_object,
    cross_rank,
    cross_size,
    get_engine,
    grouped_allreduce,
    grouped_allreduce_async,
    init,
    is_initialized,
    job_env,
    join,
    local_rank,
    local_size,
    poll,
    rank,
    reducescatter,
    reducescatter_async,
    remove_process_set,
    settings,
    shutdown,
    size,
    synchronize,
)
from spark_hvd.core.engine.engine import Handle
from spark_hvd.core.errors import (
    AuthenticationError,
    CollectiveTimeoutError,
    NotInitializedError,
    PeerFailureError,
    ShutdownError,
    SparkHvdError,
    StallError,
    TensorMismatchError,
)
from spark_hvd.core.process_sets import ProcessSet, global_process_set
from spark_hvd.core.settings import Settings

__all__ = [
    "Adasum", "Average", "AuthenticationError", "Backend", "CollectiveTimeoutError", "Handle", "Max", "Min",
    "NotInitializedError", "PeerFailureError", "ProcessSet", "Product", "ReduceOp", "Rendezvous", "Settings",
    "ShutdownError", "SparkHvdError", "StallError", "Sum", "TensorMismatchError", "add_process_set", "allgather",
    "allgather_async", "allgather_object", "allreduce", "allreduce_async", "alltoall", "alltoall_async",
    "backend_name", "barrier", "broadcast", "broadcast_async", "broadcast_object", "cross_rank", "cross_size",
    "get_engine", "global_process_set", "grouped_allreduce", "grouped_allreduce_async", "init", "is_initialized",
    "job_env", "join", "local_rank", "local_size", "poll", "rank", "reducescatter", "reducescatter_async",
    "remove_process_set", "settings", "shutdown", "size", "synchronize",
]
