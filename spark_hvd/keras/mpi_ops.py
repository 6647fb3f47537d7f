"""Collectives on TensorFlow tensors for the Keras TensorFlow backend, with the argument order of Horovod's
``horovod.tensorflow.keras``; they are ``spark_hvd.tensorflow``'s (eager or inside ``tf.function``,
differentiable)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.process_sets import ProcessSet, global_process_set
from spark_hvd.tensorflow import collectives as _tf
from spark_hvd.tensorflow.compression import Compression, Compressor
from spark_hvd.tensorflow.mpi_ops import init

__all__ = ["allgather", "allreduce", "alltoall", "broadcast", "grouped_allreduce", "init", "reducescatter"]


def allreduce(value: Any, name: str | None = None, average: bool | None = None,
              compression: type[Compressor] = Compression.none, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Reduce ``value`` across ranks (of ``process_set``; default: average); returns a new tensor of the same
    shape."""
    return _tf.allreduce(value, average=average, compression=compression, op=op, prescale_factor=prescale_factor,
                         postscale_factor=postscale_factor, name=name, process_set=process_set)


def grouped_allreduce(values: Sequence[Any], name: str | None = None, average: bool | None = None,
                      compression: type[Compressor] = Compression.none, op: ReduceOp | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Reduce several tensors across ranks (of ``process_set``) in one collective; returns new tensors."""
    return _tf.grouped_allreduce(values, average=average, compression=compression, op=op,
                                 prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                 process_set=process_set, name=name)


def allgather(value: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Every rank's (of ``process_set``) ``value`` concatenated on dimension 0 (which may differ by rank)."""
    return _tf.allgather(value, name=name, process_set=process_set)


def broadcast(value: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Root's ``value`` (``root_rank`` a global rank), as a new tensor on every rank (of ``process_set``)."""
    return _tf.broadcast(value, root_rank, name=name, process_set=process_set)


def alltoall(value: Any, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[i]`` rows of ``value`` to rank i (even split when None); returns the rows received in rank
    order, and with ``splits`` given ``(output, received_splits)`` as in Horovod."""
    return _tf.alltoall(value, splits=splits, name=name, process_set=process_set)


def reducescatter(value: Any, name: str | None = None, op: ReduceOp | None = None,
                  average: bool | None = None, process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Reduce ``value`` across ranks and return this rank's rows of the result (first ``rows % size`` ranks
    get one row more)."""
    from spark_hvd import _binding_common as common

    return _tf.reducescatter(value, op=common.resolve_op(op, average), name=name, process_set=process_set)
