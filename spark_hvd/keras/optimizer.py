"""Keras 3 ``DistributedOptimizer``: gradients averaged over all ranks, one grouped collective per step.

The wrapper is a subclass of the user's optimizer class that reduces the gradients where Keras is about to
clip and apply them (``_clip_gradients``): after local gradient accumulation (Keras's own
``gradient_accumulation_steps``, which ``backward_passes_per_step`` sets) and before clipping and the update.
Inside a compiled ``model.fit`` (TensorFlow backend) this is one ``tf.numpy_function`` holding one grouped
allreduce; on the Keras torch backend the gradients (torch tensors) go through ``spark_hvd.torch``'s grouped
allreduce.

The subclass keeps the base class's name and module, and ``get_config`` is the base's, so a saved model
reloads anywhere as the plain optimizer; :func:`spark_hvd.keras.load_model` wraps it again.
"""

from __future__ import annotations

import logging
from typing import Any

import keras

from spark_hvd import _binding_common as common
from spark_hvd.core.backend import ReduceOp

log = logging.getLogger(__name__)


class _DistributedOptimizerMixin:
    """Placed in front of a Keras optimizer class; the settings are class attributes of the subclass."""

    _hvd_compression: Any = None  # a Compressor class of the active backend's binding; None: no compression
    _hvd_op: ReduceOp = ReduceOp.AVERAGE
    _hvd_prescale: float = 1.0
    _hvd_postscale: float = 1.0

    def _clip_gradients(self, grads: Any) -> Any:
        grads = self._hvd_allreduce_gradients(list(grads))
        return super()._clip_gradients(grads)  # type: ignore[misc]

    def _hvd_allreduce_gradients(self, grads: list[Any]) -> list[Any]:
        if common.core().size() == 1:
            return grads
        present = [i for i, g in enumerate(grads) if g is not None]
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            from spark_hvd.keras import mpi_ops
            from spark_hvd.keras.compression import Compression

            dense = [tf.convert_to_tensor(grads[i]) for i in present]  # IndexedSlices -> dense
        else:  # torch backend: the gradients are torch tensors
            from spark_hvd.torch import collectives as mpi_ops  # type: ignore[no-redef]
            from spark_hvd.torch.compression import Compression  # type: ignore[no-redef]

            dense = [grads[i] for i in present]
        reduced = mpi_ops.grouped_allreduce(
            dense, name=f"{self.name}.grads", compression=self._hvd_compression or Compression.none,
            op=self._hvd_op, prescale_factor=self._hvd_prescale, postscale_factor=self._hvd_postscale)
        out = list(grads)
        for i, r in zip(present, reduced, strict=True):
            out[i] = r
        return out


_class_cache: dict[tuple, type] = {}


def wrap_optimizer_class(base: type, compression: Any = None,
                         op: ReduceOp = common.Average, gradient_predivide_factor: float = 1.0) -> type:
    """The distributed subclass of Keras optimizer class ``base`` (cached, so equal settings give one class)."""
    if not (isinstance(base, type) and issubclass(base, keras.optimizers.Optimizer)):
        raise TypeError(f"expected a keras.optimizers.Optimizer subclass, got {base!r}")
    if issubclass(base, _DistributedOptimizerMixin):
        return base
    rop = common.resolve_op(op)
    if rop not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError(f"DistributedOptimizer supports op=Average or op=Sum, got {rop}")
    prescale, postscale = common.gradient_scales(rop, gradient_predivide_factor)
    key = (base, compression, rop, prescale, postscale)
    cls = _class_cache.get(key)
    if cls is None:
        cls = type(base.__name__, (_DistributedOptimizerMixin, base), {
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "__doc__": base.__doc__,
            "_hvd_compression": compression,
            "_hvd_op": rop,
            "_hvd_prescale": prescale,
            "_hvd_postscale": postscale,
        })
        _class_cache[key] = cls
    return cls


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer,  # noqa: N802 - Horovod's name
                         name: str | None = None,
                         compression: Any = None,
                         backward_passes_per_step: int = 1,
                         op: ReduceOp = common.Average,
                         gradient_predivide_factor: float = 1.0,
                         sparse_as_dense: bool = True,
                         **kwargs: Any) -> keras.optimizers.Optimizer:
    """Wrap a Keras 3 optimizer so that ``model.fit`` applies gradients averaged over all ranks.

    Args:
        optimizer: a ``keras.optimizers.Optimizer`` (Adam, SGD, ... or a subclass of your own).
        name: a name for the new optimizer (default: the wrapped one's).
        compression: ``hvd.Compression.none`` (default) or ``hvd.Compression.fp16`` (send gradients as float16).
        backward_passes_per_step: accumulate this many batches' gradients locally (their average, Keras's
            ``gradient_accumulation_steps``) before one allreduce and one update.
        op: ``Average`` (default) or ``Sum``.
        gradient_predivide_factor: divide before the sum and multiply after (Average only).
        sparse_as_dense: sparse gradients are always sent dense (accepted for Horovod compatibility).

    Compile the model with ``jit_compile=False`` on GPU hosts (the collective cannot run inside XLA).
    The new optimizer is built from ``optimizer.get_config()``; a wrapped optimizer that was already built has
    its variables (iterations, moments) copied over.
    """
    common.require_init("DistributedOptimizer()")
    if kwargs:
        log.debug("DistributedOptimizer ignores Horovod-only arguments %s", sorted(kwargs))
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or \
            keras.config.dtype_policy().name == "mixed_float16":
        # LossScaleOptimizer skips the inner update on non-finite local gradients, so ranks could disagree on
        # whether the collective runs and wait on each other: refuse rather than risk a hang
        raise NotImplementedError("DistributedOptimizer does not support loss scaling (LossScaleOptimizer / the "
                                  "mixed_float16 policy) yet; use float32 or bfloat16 ('mixed_bfloat16')")
    cls = wrap_optimizer_class(type(optimizer), compression, op, gradient_predivide_factor)
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    if backward_passes_per_step > 1:
        config["gradient_accumulation_steps"] = backward_passes_per_step
    new = cls.from_config(config)
    if optimizer.built:
        variables = list(getattr(optimizer, "_trainable_variables", []))
        if variables:
            new.build(variables)
            if len(new.variables) == len(optimizer.variables):
                for dst, src in zip(new.variables, optimizer.variables, strict=True):
                    dst.assign(src)
            else:
                log.warning("DistributedOptimizer: the wrapped optimizer's state was not copied (its variables "
                            "do not match one to one after changing backward_passes_per_step)")
    return new
