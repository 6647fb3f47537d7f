"""Backend-neutral helpers of the Keras binding (work on the TensorFlow and the torch Keras backends)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from spark_hvd import _binding_common as common


def broadcast_variables(variables: Sequence[Any], root_rank: int = 0, prefix: str = "bcast.var") -> None:
    """Assign root's values to ``variables`` (Keras variables, or tf.Variables) on every rank; eager only."""
    common.require_init("broadcast_variables()")
    c = common.core()
    bufs, handles = [], []
    for i, v in enumerate(variables):
        value = v.numpy() if hasattr(v, "numpy") and not isinstance(v, keras.Variable) else \
            keras.ops.convert_to_numpy(v)
        buf = np.array(value, copy=True, order="C")
        view, _ = common.to_core_buffer(buf)
        bufs.append(buf)
        handles.append(c.broadcast_async(view, root_rank, name=f"{prefix}.{i}"))
    for v, buf, h in zip(variables, bufs, handles, strict=True):
        c.synchronize(h)
        v.assign(buf)


def broadcast_global_variables(root_rank: int = 0) -> None:
    """Horovod's TF1-style broadcast of "all global variables": Keras 3 has no global variable collection.

    Always raises ``NotImplementedError`` naming what to use instead.
    """
    raise NotImplementedError(
        "broadcast_global_variables() needs TensorFlow 1's global variable collection, which Keras 3 does not have; "
        "use hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) in model.fit, or "
        f"hvd.broadcast_variables(model.variables, root_rank={root_rank})")
