"""``DistributedOptimizer`` for TensorFlow loops: Keras 3 optimizers, and TF1's ``tf.compat.v1.train`` ones.

A Keras optimizer (what ``tf.keras.optimizers`` is on TensorFlow >= 2.16) becomes the distributed subclass that
``spark_hvd.keras`` makes too (``spark_hvd._keras_common.optimizer``), reducing with this binding's collectives:
``opt.apply_gradients(zip(grads, vars))`` in a custom loop averages the gradients over the ranks first (one grouped
allreduce), and Horovod's ``opt.compute_gradients(loss, var_list, tape)`` / ``_compute_gradients`` contract is there
too. A ``tf.compat.v1.train.Optimizer`` is wrapped so that
``compute_gradients`` returns reduced gradients (Horovod's TF1 behaviour); ``minimize`` goes through it.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from spark_hvd import _binding_common as common
from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.process_sets import ProcessSet, global_process_set
from spark_hvd.tensorflow import collectives
from spark_hvd.tensorflow.compression import Compression, Compressor
from spark_hvd.tensorflow.gradient_tape import reduce_gradients


class _LegacyDistributedOptimizer(tf.compat.v1.train.Optimizer):
    """A ``tf.compat.v1.train.Optimizer`` whose ``compute_gradients`` reduces the gradients over the ranks."""

    def __init__(self, optimizer: Any, name: str | None, use_locking: bool, settings: dict[str, Any]) -> None:
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}", use_locking=use_locking)
        self._optimizer = optimizer
        self._settings = settings
        self._local_ids: dict[int, Any] = {}

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient local to this rank."""
        self._local_ids[id(var)] = var

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        pairs = list(self._optimizer.compute_gradients(*args, **kwargs))
        if not pairs:
            return pairs
        grads, variables = zip(*pairs, strict=True)
        reduced = reduce_gradients(grads, variables, local_ids=set(self._local_ids), **self._settings)
        return list(zip(reduced, variables, strict=True))

    def apply_gradients(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.apply_gradients(*args, **kwargs)

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(optimizer: Any, name: str | None = None, use_locking: bool = False,  # noqa: N802
                         device_dense: str = "", device_sparse: str = "",
                         compression: type[Compressor] = Compression.none, sparse_as_dense: bool = False,
                         backward_passes_per_step: int = 1, op: ReduceOp = common.Average,
                         gradient_predivide_factor: float = 1.0, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Any = None,
                         process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Horovod's ``hvd.DistributedOptimizer`` of ``horovod.tensorflow`` (same arguments, same order).

    ``optimizer``: a Keras 3 optimizer (``tf.keras.optimizers.Adam(...)``; Keras on TensorFlow), wrapped as
    :func:`spark_hvd.keras.DistributedOptimizer` wraps it (see there for ``backward_passes_per_step``,
    ``average_aggregated_gradients``, ``num_groups``, ``groups``), or a ``tf.compat.v1.train.Optimizer``
    (``backward_passes_per_step`` must then be 1). ``op`` is ``Average`` or ``Sum``, or with a Keras optimizer
    ``Adasum`` (the Keras delta optimizer; Horovod's TensorFlow refuses Adasum with a Keras optimizer);
    ``gradient_predivide_factor`` splits the average before and after the sum; ``process_set`` reduces over its
    ranks only. ``device_dense``, ``device_sparse`` and ``use_locking`` (Keras) have no effect.
    """
    common.require_init("DistributedOptimizer()")
    rop = common.resolve_op(op)
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if backward_passes_per_step != 1:
            raise NotImplementedError("DistributedOptimizer of a tf.compat.v1.train.Optimizer supports "
                                      "backward_passes_per_step=1 only; use a Keras optimizer to aggregate passes")
        if rop not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise ValueError(f"DistributedOptimizer supports op=Average or op=Sum, got {rop}")
        common.gradient_scales(rop, gradient_predivide_factor)
        settings = {"compression": compression, "sparse_as_dense": sparse_as_dense, "op": rop,
                    "gradient_predivide_factor": gradient_predivide_factor, "process_set": process_set,
                    "scale_local": scale_local_gradients}
        return _LegacyDistributedOptimizer(optimizer, name, use_locking, settings)
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer takes a Keras optimizer or a tf.compat.v1.train.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if keras.backend.backend() != "tensorflow":
        raise ValueError(f"spark_hvd.tensorflow.DistributedOptimizer wraps Keras optimizers of Keras's TensorFlow "
                         f"backend; this process runs Keras on {keras.backend.backend()!r}: use "
                         f"spark_hvd.keras.DistributedOptimizer")
    from spark_hvd._keras_common.optimizer import DistributedOptimizer as keras_distributed

    return keras_distributed(optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
                             compression=compression, sparse_as_dense=sparse_as_dense,
                             gradient_predivide_factor=gradient_predivide_factor, op=rop,
                             backward_passes_per_step=backward_passes_per_step,
                             average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
                             groups=groups,
                             process_set=None if process_set.process_set_id == 0 else process_set,
                             scale_local_gradients=scale_local_gradients, ops=_collectives)


def _collectives() -> tuple[Any, Any]:
    """The collectives a wrapped Keras optimizer reduces with: this binding's, and its ``Compression``."""
    return collectives, Compression
