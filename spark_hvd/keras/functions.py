"""Backend-neutral helpers of the Keras binding (work on the TensorFlow and the torch Keras backends)."""

from __future__ import annotations

from spark_hvd._keras_common.state import broadcast_variables

__all__ = ["broadcast_global_variables", "broadcast_variables"]


def broadcast_global_variables(root_rank: int = 0) -> None:
    """Horovod's TF1-style broadcast of "all global variables": Keras 3 has no global variable collection.

    Always raises ``NotImplementedError`` naming what to use instead.
    """
    raise NotImplementedError(
        "broadcast_global_variables() needs TensorFlow 1's global variable collection, which Keras 3 does not have; "
        "use hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) in model.fit, or "
        f"hvd.broadcast_variables(model.variables, root_rank={root_rank})")
