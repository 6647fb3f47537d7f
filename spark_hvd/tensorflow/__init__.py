"""Horovod's TensorFlow 2 API over the spark_hvd core: ``import spark_hvd.tensorflow as hvd``.

Example (a custom training loop)::

    import spark_hvd.tensorflow as hvd
    hvd.init()

    @tf.function
    def step(x, y, first):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss

Collectives take ``tf.Tensor`` / ``tf.Variable`` (and ``tf.IndexedSlices`` for allreduce), run eagerly or inside
``tf.function`` / TF1 graphs, and have Horovod's gradients (``collectives``).
"""

from __future__ import annotations

from spark_hvd import _process_api
from spark_hvd._process_api import *  # noqa: F403 - the process API every binding exports (_process_api.py)
from spark_hvd.tensorflow import elastic, util
from spark_hvd.tensorflow.collectives import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from spark_hvd.tensorflow.compression import Compression
from spark_hvd.tensorflow.functions import broadcast_global_variables, broadcast_object_fn, broadcast_variables
from spark_hvd.tensorflow.gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from spark_hvd.tensorflow.mpi_ops import (
    init,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    size_op,
)
from spark_hvd.tensorflow.optimizer import DistributedOptimizer
from spark_hvd.tensorflow.sync_batch_norm import SyncBatchNormalization
from spark_hvd.tensorflow.util import _executing_eagerly  # noqa: F401 - Horovod's tests call hvd._executing_eagerly


def nccl_built() -> int:
    """Horovod's NCCL version number of the device group that eager GPU tensors reach by DLPack (torch's NCCL; see
    ``spark_hvd.torch.nccl_built``), or 0 when torch is not installed."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return 0
    from spark_hvd.torch.build import nccl_built as torch_nccl_built

    return torch_nccl_built()


def cuda_built() -> bool:
    """False: this binding has no CUDA kernels of its own."""
    return False


def rocm_built() -> bool:
    """False: this binding has no ROCm kernels of its own."""
    return False


__all__ = [
    *_process_api.__all__,
    "Compression", "DistributedGradientTape", "DistributedOptimizer", "PartialDistributedGradientTape",
    "SyncBatchNormalization", "allgather", "allreduce", "alltoall", "broadcast", "broadcast_",
    "broadcast_global_variables", "broadcast_object_fn", "broadcast_variables", "cuda_built", "elastic",
    "grouped_allgather", "grouped_allreduce", "grouped_reducescatter", "init", "local_rank_op", "local_size_op",
    "nccl_built", "process_set_included_op", "rank_op", "reducescatter", "rocm_built", "size_op", "util",
]
