"""The Horovod Keras API for Keras 3 over the spark_hvd core: ``import spark_hvd.keras as hvd``.

TensorFlow backend: collectives take TF tensors (eagerly or inside ``tf.function``). Torch backend
(``KERAS_BACKEND=torch``): they take torch tensors (``spark_hvd.torch``'s functions). JAX backend
(``KERAS_BACKEND=jax``): they take JAX arrays (``spark_hvd.keras.jax_ops``; the optimizer's reduction runs inside
``jax.jit`` as an ordered host callback). ``DistributedOptimizer``, the callbacks and ``load_model`` work on all
three.

Example::

    import spark_hvd.keras as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hvd.size()))
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()])
"""

from __future__ import annotations

from typing import Any

import keras

from spark_hvd import _process_api
from spark_hvd._process_api import *  # noqa: F403 - the process API every binding exports (_process_api.py)
from spark_hvd.keras import callbacks, elastic
from spark_hvd.keras.distributed_optimizer import (
    DistributedOptimizer,
    PartialDistributedOptimizer,
    wrap_optimizer_class,
)
from spark_hvd.keras.functions import broadcast_global_variables, broadcast_variables

# the collectives, ``init`` and ``Compression`` on the tensors of Keras's backend: one module of each backend has them
if keras.backend.backend() == "tensorflow":
    from spark_hvd.keras import mpi_ops as _ops
elif keras.backend.backend() == "torch":  # Keras on torch: the tensors are torch tensors
    import spark_hvd.torch as _ops  # type: ignore[no-redef]
elif keras.backend.backend() == "jax":  # Keras on JAX: the arrays are jax.Arrays (CPU)
    from spark_hvd.keras import jax_ops as _ops  # type: ignore[no-redef]
else:
    raise ImportError(f"spark_hvd.keras supports the Keras TensorFlow, torch and JAX backends; this process runs "
                      f"Keras on {keras.backend.backend()!r} (set KERAS_BACKEND=tensorflow, torch or jax)")
Compression, allgather, allreduce, alltoall, broadcast, grouped_allreduce, init, reducescatter = (
    _ops.Compression, _ops.allgather, _ops.allreduce, _ops.alltoall, _ops.broadcast, _ops.grouped_allreduce, _ops.init,
    _ops.reducescatter)


def _builtin_optimizer_classes() -> list[type]:
    out = []
    for attr in dir(keras.optimizers):
        obj = getattr(keras.optimizers, attr)
        if (isinstance(obj, type) and issubclass(obj, keras.optimizers.Optimizer)
                and obj is not keras.optimizers.Optimizer and obj.__name__ != "LossScaleOptimizer"):
            out.append(obj)
    return out


def load_model(filepath: Any, custom_objects: dict[str, Any] | None = None,
               compression: Any = None, op: Any = _process_api.Average, gradient_predivide_factor: float = 1.0,
               compile: bool = True, safe_mode: bool = True,  # noqa: A002 - Keras's name
               average_aggregated_gradients: bool = False) -> keras.Model:
    """Load a saved model (``.keras``) with its optimizer wrapped in :func:`DistributedOptimizer` again.

    The optimizer's saved state (iterations, moments) is restored into the wrapped optimizer. Optimizer
    classes of your own go in ``custom_objects`` and are wrapped too.
    """
    objects: dict[str, Any] = {}
    for cls in _builtin_optimizer_classes():
        objects[cls.__name__] = wrap_optimizer_class(cls, compression, op, gradient_predivide_factor)
    for key, value in (custom_objects or {}).items():
        if isinstance(value, type) and issubclass(value, keras.optimizers.Optimizer):
            objects[key] = wrap_optimizer_class(value, compression, op, gradient_predivide_factor)
        else:
            objects[key] = value
    return keras.saving.load_model(filepath, custom_objects=objects, compile=compile, safe_mode=safe_mode)


def nccl_built() -> int:
    """Horovod's NCCL version number (see ``spark_hvd.torch.nccl_built``) on the Keras torch backend; 0 on the
    TensorFlow backend, whose collectives go through the core's host buffers."""
    if keras.backend.backend() == "torch":
        from spark_hvd.torch.build import nccl_built as torch_nccl_built

        return torch_nccl_built()
    return 0


__all__ = [
    *_process_api.__all__,
    "Compression", "DistributedOptimizer", "PartialDistributedOptimizer", "allgather", "allreduce", "alltoall",
    "broadcast", "broadcast_global_variables", "broadcast_variables", "callbacks", "elastic", "grouped_allreduce",
    "init", "load_model", "nccl_built", "reducescatter",
]
