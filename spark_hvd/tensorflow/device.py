"""TF tensors on the device path: a GPU tensor reaches the device group without a copy through host memory.

Eagerly, a TF tensor on a GPU is handed to torch by DLPack (``tf.experimental.dlpack.to_dlpack`` ->
``torch.from_dlpack``: the same memory), copied once on its device (TF tensors are immutable; the collective
works in place), reduced where it lies by ``spark_hvd.torch``'s device path (NCCL, with the engine's negotiation,
fusion and error naming), and handed back to TF by DLPack. ``SPARK_HVD_DEVICE_BACKEND=gloo`` sends CPU tensors
down the same path (the CPU stand-in the tests use); ``none`` keeps GPU tensors on the host path. Inside a graph
(``tf.function``) tensors go through ``tf.numpy_function`` and host memory.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from spark_hvd import _binding_common as common
from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.engine.device import device_key
from spark_hvd.core.process_sets import ProcessSet

_TORCH = importlib.util.find_spec("torch") is not None


def on_device_path(tensors: Sequence[Any]) -> bool:
    """True when these (eager) tensors take the device path: on a GPU (unless ``SPARK_HVD_DEVICE_BACKEND=none``),
    or on the CPU under ``SPARK_HVD_DEVICE_BACKEND=gloo``; torch must be installed."""
    if not _TORCH or not tensors or not tf.executing_eagerly():
        return False
    backend = common.core().settings().device_backend
    kinds = {"cuda" if "GPU" in (getattr(t, "device", "") or "").upper() else "cpu" for t in tensors}
    keys = {device_key(kind, backend) for kind in kinds}
    if len(keys) > 1:
        raise ValueError(f"a grouped collective mixes GPU and host-memory TensorFlow tensors (devices: "
                         f"{sorted({t.device for t in tensors})}); move them to one device")
    return keys.pop() is not None


def to_torch(tensor: tf.Tensor) -> Any:
    """The torch tensor over ``tensor``'s memory (no copy)."""
    import torch

    return torch.from_dlpack(tf.experimental.dlpack.to_dlpack(tensor))


def to_tf(tensor: Any) -> tf.Tensor:
    """The TF tensor over a torch tensor's memory (no copy)."""
    import torch.utils.dlpack

    return tf.experimental.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(tensor.contiguous()))


def allreduce(tensors: Sequence[tf.Tensor], names: Sequence[str | None], op: ReduceOp, prescale: float,
              postscale: float, process_set: ProcessSet) -> list[tf.Tensor]:
    """A grouped allreduce of GPU tensors on the device group; new TF tensors on the same devices."""
    from spark_hvd.torch import mpi_ops as torch_ops

    work = [to_torch(t).clone() for t in tensors]  # the one copy, on the device
    name = names[0] if len(names) == 1 else (None if names[0] is None else names[0].rsplit(".", 1)[0])
    if len(work) == 1:
        torch_ops.allreduce_(work[0], name=name, op=op, prescale_factor=prescale, postscale_factor=postscale,
                             process_set=process_set)
    else:
        torch_ops.grouped_allreduce_(work, name=name, op=op, prescale_factor=prescale, postscale_factor=postscale,
                                     process_set=process_set)
    return [to_tf(w) for w in work]


def allgather(tensors: Sequence[tf.Tensor], names: Sequence[str | None], process_set: ProcessSet) -> list[tf.Tensor]:
    """Allgathers of GPU tensors on the device group, submitted together."""
    from spark_hvd.torch import mpi_ops as torch_ops

    handles = [torch_ops.allgather_async(to_torch(t), name=n, process_set=process_set)
               for t, n in zip(tensors, names, strict=True)]
    return [to_tf(torch_ops.synchronize(h)) for h in handles]


def broadcast(tensor: tf.Tensor, root_rank: int, name: str | None, process_set: ProcessSet) -> tf.Tensor:
    """A broadcast of a GPU tensor on the device group."""
    from spark_hvd.torch import mpi_ops as torch_ops

    work = to_torch(tensor).clone()
    return to_tf(torch_ops.broadcast_(work, root_rank, name=name, process_set=process_set))
