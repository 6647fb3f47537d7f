"""Keras 3 ``DistributedOptimizer`` of ``spark_hvd.keras``: the wrapper both Keras bindings share
(``spark_hvd._keras_common.optimizer``, where it is described), reducing with the collectives of the backend Keras
runs on: TensorFlow tensors by ``spark_hvd.tensorflow``'s, torch tensors by ``spark_hvd.torch``'s, JAX arrays by
``spark_hvd.keras.jax_ops``."""

from __future__ import annotations

import functools
from typing import Any

import keras

from spark_hvd._keras_common import optimizer as _shared


def backend_ops() -> tuple[Any, Any]:
    """(module with ``grouped_allreduce``, its ``Compression``) of the backend Keras runs on in this process."""
    if keras.backend.backend() == "tensorflow":
        from spark_hvd.keras import mpi_ops
        from spark_hvd.keras.compression import Compression
    elif keras.backend.backend() == "jax":  # JAX arrays, traced inside Keras's jitted train step
        from spark_hvd.keras import jax_ops as mpi_ops  # type: ignore[no-redef]
        from spark_hvd.keras.jax_ops import Compression  # type: ignore[no-redef]
    else:  # torch backend: the gradients are torch tensors
        from spark_hvd.torch import collectives as mpi_ops  # type: ignore[no-redef]
        from spark_hvd.torch.compression import Compression  # type: ignore[no-redef]
    return mpi_ops, Compression


@functools.wraps(_shared.wrap_optimizer_class)
def wrap_optimizer_class(*args: Any, **kwargs: Any) -> type:
    return _shared.wrap_optimizer_class(*args, ops=backend_ops, **kwargs)


@functools.wraps(_shared.DistributedOptimizer)
def DistributedOptimizer(*args: Any, **kwargs: Any) -> keras.optimizers.Optimizer:  # noqa: N802 - Horovod's name
    return _shared.DistributedOptimizer(*args, ops=backend_ops, **kwargs)


@functools.wraps(_shared.PartialDistributedOptimizer)
def PartialDistributedOptimizer(*args: Any, **kwargs: Any) -> keras.optimizers.Optimizer:  # noqa: N802
    return _shared.PartialDistributedOptimizer(*args, ops=backend_ops, **kwargs)
