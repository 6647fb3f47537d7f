"""The process API that every binding exports under the same names: ``hvd.rank()``, ``hvd.Sum``,
``hvd.add_process_set`` ... are the same objects in ``spark_hvd.torch``, ``spark_hvd.keras``,
``spark_hvd.tensorflow`` and ``spark_hvd.mxnet`` (and in the torch and MXNet ``mpi_ops`` modules, as in Horovod).

Each of them takes the list from here, ``from spark_hvd._process_api import *``, and lists ``*__all__`` first in its
own ``__all__``: a name added here reaches every binding at once. What differs between the bindings (``init``, the
collectives, ``Compression``, the optimizers) stays in each binding.
"""

from __future__ import annotations

from spark_hvd._binding_common import (
    Adasum,
    Average,
    HorovodInternalError,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    allgather_object,
    barrier,
    broadcast_object,
    ccl_built,
    cross_rank,
    cross_size,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    rank,
    remove_process_set,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from spark_hvd.core.errors import NotInitializedError

__all__ = [
    "Adasum", "Average", "HorovodInternalError", "Max", "Min", "NotInitializedError", "ProcessSet", "Product", "Sum",
    "add_process_set", "allgather_object", "barrier", "broadcast_object", "ccl_built", "cross_rank", "cross_size",
    "ddl_built", "global_process_set", "gloo_built", "gloo_enabled", "is_homogeneous", "is_initialized", "join",
    "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "rank", "remove_process_set",
    "shutdown", "size", "start_timeline", "stop_timeline",
]
