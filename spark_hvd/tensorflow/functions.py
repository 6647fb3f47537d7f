"""Variables and Python objects across ranks: ``broadcast_variables``, ``broadcast_global_variables``,
``broadcast_object_fn``.

Eagerly the variables' values go out as one batch of asynchronous broadcasts and are assigned when they are back;
inside a graph (``tf.function`` or TF1) each variable gets a broadcast op and an assign, grouped into one op.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from spark_hvd import _binding_common as common
from spark_hvd.core.process_sets import ProcessSet, global_process_set
from spark_hvd.tensorflow import mpi_ops


def broadcast_variables(variables: Sequence[Any], root_rank: int = 0,
                        process_set: ProcessSet = global_process_set, inplace: bool = False) -> Any:
    """Assign root's values (``root_rank`` a global rank) to ``variables`` (``tf.Variable`` or Keras variables) on
    every rank of ``process_set``. Eagerly returns None when done; in a graph returns the op that does it.
    ``inplace`` is accepted for Horovod compatibility (the values are assigned either way)."""
    variables = list(variables)
    if not tf.executing_eagerly():  # the ops check init() and membership (now, or when they run: mpi_ops)
        assigns = []
        for v in variables:
            value = tf.convert_to_tensor(v)
            out = mpi_ops.broadcast_raw(value, root_rank, mpi_ops.op_name("Broadcast", None, [value]), process_set)
            assigns.append(v.assign(out))
        return tf.group(*assigns)
    common.require_init("broadcast_variables()")
    common.check_member(process_set, "broadcast_variables()")
    c = common.core()
    bufs, handles = [], []
    for v in variables:
        buf = np.array(tf.convert_to_tensor(v).numpy(), copy=True, order="C")
        bufs.append(buf)
        handles.append(c.broadcast_async(common.to_core_buffer(buf)[0], root_rank, process_set=process_set))
    for v, buf, h in zip(variables, bufs, handles, strict=True):
        c.synchronize(h)
        v.assign(buf)
    return None


def broadcast_global_variables(root_rank: int) -> Any:
    """TF1 graphs: the op that broadcasts every global variable (``tf.compat.v1.global_variables()``) from
    ``root_rank``. Eagerly there is no global variable collection: raises ``RuntimeError`` (Horovod's) naming
    :func:`broadcast_variables` instead."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution (TF2 has no global "
                           "variable collection); use hvd.broadcast_variables(model.variables, root_rank=0) "
                           "and hvd.broadcast_variables(optimizer.variables, root_rank=0)")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: ProcessSet = global_process_set) -> Callable[[Any], Any]:
    """Horovod's TF1 helper: a function ``f(obj)`` returning root's ``obj``. Here it is
    :func:`spark_hvd.tensorflow.broadcast_object` (no session is needed)."""
    def broadcast(obj: Any) -> Any:
        return common.broadcast_object(obj, root_rank=root_rank, name=name, process_set=process_set)
    return broadcast
