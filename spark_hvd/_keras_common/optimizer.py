"""Keras 3 ``DistributedOptimizer``: gradients averaged over all ranks, one grouped collective per step.

Shared by ``spark_hvd.keras`` and ``spark_hvd.tensorflow`` (whose ``DistributedOptimizer`` takes Keras optimizers
too); each binding passes ``ops``, the collectives that reduce the gradients (a function returning a module with
``grouped_allreduce`` and its ``Compression``), so this module imports neither binding.

The wrapper is a subclass of the user's optimizer class that reduces the gradients where Keras is about to
clip and apply them (``_clip_gradients``): after local gradient accumulation (Keras's own
``gradient_accumulation_steps``, which ``backward_passes_per_step`` sets) and before clipping and the update.
Inside a compiled ``model.fit`` (TensorFlow backend) this is one ``tf.numpy_function`` holding one grouped
allreduce; on the Keras torch backend the gradients (torch tensors) go through ``spark_hvd.torch``'s grouped
allreduce. (Keras 3.3-3.4 clip each pass before accumulating: there the reduction runs once per pass, with the
same result; ``spark_hvd._keras_common.compat`` holds what differs between Keras releases.)

Horovod's custom-loop contract, ``_compute_gradients(loss, var_list, grad_loss, tape)`` (TensorFlow backend): the
tape's gradients come back reduced (on the last of ``backward_passes_per_step`` passes; the others return the local
sum so far) and the ``apply_gradients`` that follows applies them without reducing again.

Loss scaling (``keras.optimizers.LossScaleOptimizer``, which ``compile`` puts around the optimizer under the
``mixed_float16`` policy): the wrapper is a subclass of the ``LossScaleOptimizer`` whose ``apply`` reduces the
*scaled* gradients once, before the loss-scale optimizer checks them for inf/nan; its inner optimizer stays plain.
Every rank then sees the same averaged gradients, finds the same overflow, skips the same steps and halves or
doubles the same scale (an overflow on any rank makes the average non-finite on every rank), so no rank waits on a
collective that another rank skipped.

The subclass keeps the base class's name and module, and ``get_config`` is the base's, so a saved model
reloads anywhere as the plain optimizer; :func:`spark_hvd.keras.load_model` wraps it again.

(A little over 400 lines: both reduction paths, ``apply`` and ``_compute_gradients``, share the mixin's helpers.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import keras

from spark_hvd import _binding_common as common
from spark_hvd._keras_common import compat
from spark_hvd._keras_common.adasum_optimizer import DeltaAdasumMixin
from spark_hvd.core.backend import ReduceOp

log = logging.getLogger(__name__)


class _AggregationHelper:
    """Horovod's ``optimizer._agg_helper`` (``backward_passes_per_step > 1``), read from the optimizer's state:
    ``counter`` is the number of passes summed locally since the last reduction (``0`` right after an update)."""

    def __init__(self, optimizer: keras.optimizers.Optimizer, backward_passes_per_step: int,
                 average_aggregated_gradients: bool) -> None:
        self._optimizer = optimizer
        self.backward_passes_per_step = backward_passes_per_step
        self.average_aggregated_gradients = average_aggregated_gradients

    @property
    def counter(self) -> Any:
        """Passes since the last reduction, a scalar tensor (the optimizer's pass count modulo the passes/step)."""
        return keras.ops.mod(compat.pass_counter(self._optimizer), self.backward_passes_per_step)


class _DistributedOptimizerMixin:
    """Placed in front of a Keras optimizer class; the settings are class attributes of the subclass."""

    _hvd_compression: Any = None  # a Compressor class of the active backend's binding; None: no compression
    _hvd_ops: Callable[[], tuple[Any, Any]]  # the binding's: () -> (module with grouped_allreduce, its Compression)
    _hvd_op: ReduceOp = ReduceOp.AVERAGE
    _hvd_prescale: float = 1.0
    _hvd_postscale: float = 1.0
    _hvd_average_aggregated: bool = False  # backward_passes_per_step > 1: average the passes (True) or sum them
    _hvd_scale_local: bool = True  # divide the gradients of local variables by size (Horovod's default)

    @property
    def _agg_helper(self) -> _AggregationHelper | None:
        """Horovod's local gradient aggregation state: ``None`` unless ``backward_passes_per_step > 1``."""
        steps = getattr(self, "gradient_accumulation_steps", None)
        return _AggregationHelper(self, int(steps), self._hvd_average_aggregated) if steps else None

    def register_local_var(self, var: Any) -> None:
        """Keep ``var`` local to each rank (Horovod's): its gradient is not reduced, only divided by ``size``
        when ``scale_local_gradients`` (the default)."""
        local = self.__dict__.setdefault("_hvd_local_ids", {})
        local[id(var)] = var  # the variable itself is kept, so its id stays unique

    def compute_gradients(self, loss: Any, var_list: Any, tape: Any = None) -> list[tuple[Any, Any]]:
        """Horovod's public name of :meth:`_compute_gradients`."""
        return self._compute_gradients(loss, var_list, None, tape)

    def _compute_gradients(self, loss: Any, var_list: Any, grad_loss: Any = None,
                           tape: Any = None) -> list[tuple[Any, Any]]:
        """Horovod's contract (TensorFlow backend): the gradients of ``loss`` (a tensor recorded on ``tape``, or a
        callable evaluated on a new tape) with respect to ``var_list``, reduced over the ranks, as
        ``[(gradient, variable), ...]``; the following ``apply_gradients`` does not reduce them again.

        With ``backward_passes_per_step=k`` the passes are summed locally; on the k-th pass the sum is reduced
        (and divided by k when ``average_aggregated_gradients``) and the next ``apply_gradients`` updates the
        variables; on the other passes the local sum so far comes back and ``apply_gradients`` only counts the
        pass (``iterations``).
        """
        if keras.backend.backend() != "tensorflow":
            raise NotImplementedError(
                f"DistributedOptimizer._compute_gradients needs the Keras TensorFlow backend (a tf.GradientTape); "
                f"this process runs Keras on {keras.backend.backend()!r}: compute the gradients with your backend "
                f"and call apply_gradients (it reduces them)")
        import tensorflow as tf

        var_list = list(var_list() if callable(var_list) else var_list)
        if callable(loss):
            tape = tape if tape is not None else tf.GradientTape()
            with tape:
                tape.watch(var_list)
                loss = loss()
        elif tape is None:
            raise ValueError("DistributedOptimizer._compute_gradients: a loss tensor needs the tape that recorded it "
                             "(tape=...); or pass the loss as a callable")
        grads = [None if g is None else tf.convert_to_tensor(g)  # IndexedSlices -> dense (sparse_as_dense)
                 for g in tape.gradient(loss, var_list, output_gradients=grad_loss)]
        steps = getattr(self, "gradient_accumulation_steps", None)
        if not steps:
            reduced = self._hvd_allreduce_gradients(grads, var_list, pass_factor=1.0)
        else:
            reduced = self._hvd_aggregate_passes(grads, var_list, int(steps))
        self.__dict__["_hvd_pending_reduced"] = True
        return list(zip(reduced, var_list, strict=True))

    def _hvd_aggregate_passes(self, grads: list[Any], var_list: list[Any], steps: int) -> list[Any]:
        """Add ``grads`` to the optimizer's gradient accumulators; on the last pass of ``steps`` reduce the sum and
        zero the accumulators (the pass count is ``compat.pass_counter``, which ``apply_gradients`` advances)."""
        import tensorflow as tf

        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(var_list)
            self.built = True
        present = [i for i, g in enumerate(grads) if g is not None]
        accs = [self._accumulated_gradients[self._get_variable_index(var_list[i])] for i in present]
        sums = [acc + tf.cast(grads[i], acc.dtype) for i, acc in zip(present, accs, strict=True)]
        factor = 1.0 / steps if self._hvd_average_aggregated else 1.0

        def reduce_and_clear() -> list[Any]:
            full: list[Any] = [None] * len(grads)
            for i, s in zip(present, sums, strict=True):
                full[i] = s
            out = self._hvd_allreduce_gradients(full, var_list, pass_factor=factor)
            with tf.control_dependencies([o for o in out if o is not None]):
                clear = [compat.assign(acc, tf.zeros_like(acc)) for acc in accs]
            with tf.control_dependencies(clear):
                return [tf.identity(out[i]) for i in present]

        def keep() -> list[Any]:
            with tf.control_dependencies([compat.assign(acc, s) for acc, s in zip(accs, sums, strict=True)]):
                return [tf.identity(s) for s in sums]

        last = tf.equal((compat.pass_counter(self) + 1) % steps, 0)
        result = tf.cond(last, reduce_and_clear, keep) if present else []
        out: list[Any] = [None] * len(grads)
        for i, r in zip(present, result, strict=True):
            out[i] = r
        return out

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        self.__dict__["_hvd_prereduced"] = self.__dict__.pop("_hvd_pending_reduced", False)
        try:
            return super().apply(grads, trainable_variables)  # type: ignore[misc]
        finally:
            self.__dict__["_hvd_prereduced"] = False

    def _filter_empty_gradients(self, grads: Any, variables: Any) -> Any:
        grads, variables = super()._filter_empty_gradients(grads, variables)  # type: ignore[misc]
        # the variables of _clip_gradients' grads where apply clips before _backend_apply_gradients (Keras 3.3-3.4)
        self.__dict__["_hvd_apply_vars"] = list(variables)
        return grads, variables

    def _backend_apply_gradients(self, grads: Any, trainable_variables: Any) -> Any:
        self.__dict__["_hvd_apply_vars"] = list(trainable_variables)  # the variables of _clip_gradients' grads
        base = super()
        steps = getattr(self, "gradient_accumulation_steps", None)
        if not (self.__dict__.get("_hvd_prereduced") and steps):
            return base._backend_apply_gradients(grads, trainable_variables)  # type: ignore[misc]

        def update() -> None:  # the last pass: the summed, reduced gradients, without Keras's accumulation
            self.gradient_accumulation_steps = None
            try:
                base._backend_apply_gradients(grads, trainable_variables)  # type: ignore[misc]
            finally:
                self.gradient_accumulation_steps = steps

        keras.ops.cond((compat.pass_counter(self) + 1) % steps == 0, update,
                       lambda: compat.advance_skipped_pass(self))
        return None

    def _clip_gradients(self, grads: Any) -> Any:
        if not self.__dict__.get("_hvd_prereduced"):
            grads = self._hvd_allreduce_gradients(list(grads), self.__dict__.get("_hvd_apply_vars") or [],
                                                  pass_factor=self._hvd_pass_factor())
        return super()._clip_gradients(grads)  # type: ignore[misc]

    def _hvd_local_indices(self, variables: list[Any], count: int) -> set[int]:
        local = self.__dict__.get("_hvd_local_ids")
        if not local:
            return set()
        if len(variables) != count:
            raise RuntimeError(f"DistributedOptimizer with local variables: {count} gradients but "
                               f"{len(variables)} variables to apply them to")
        return {i for i, v in enumerate(variables) if id(v) in local}

    def _hvd_pass_factor(self) -> float:
        """Keras hands over the *average* of the accumulated passes; Horovod's default sums them."""
        steps = getattr(self, "gradient_accumulation_steps", None) or 1
        return 1.0 if self._hvd_average_aggregated else float(steps)

    def _hvd_allreduce_gradients(self, grads: list[Any], variables: list[Any], pass_factor: float) -> list[Any]:
        """Reduce ``grads`` (of ``variables``) over the process set, all times ``pass_factor``; the gradients of
        local variables are not reduced, only scaled (by ``pass_factor / size`` with ``scale_local_gradients``)."""
        process_set = self.__dict__.get("_hvd_process_set") or common.global_process_set
        if process_set.process_set_id == 0:
            size = common.core().size()
        else:  # a rank outside the set applies its own gradients, as in Horovod
            size = process_set.size() if process_set.included() else 1
        local = self._hvd_local_indices(variables, len(grads))
        if local:
            factor = pass_factor / (size if self._hvd_scale_local else 1)
            grads = [g * factor if i in local and g is not None and factor != 1.0 else g for i, g in enumerate(grads)]
        if size == 1:
            return [g * pass_factor if i not in local and g is not None and pass_factor != 1.0 else g
                    for i, g in enumerate(grads)]
        present = [i for i, g in enumerate(grads) if g is not None and i not in local]
        mpi_ops, Compression = self._hvd_ops()  # noqa: N806 - Horovod's name
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            dense = [tf.convert_to_tensor(grads[i]) for i in present]  # IndexedSlices -> dense
        else:  # torch tensors, or JAX arrays traced inside Keras's jitted train step
            dense = [grads[i] for i in present]
        reduced = mpi_ops.grouped_allreduce(
            dense, name=f"{self.name}.grads", compression=self._hvd_compression or Compression.none,
            op=self._hvd_op, prescale_factor=self._hvd_prescale,
            postscale_factor=self._hvd_postscale * pass_factor, process_set=process_set)
        out = list(grads)
        for i, r in zip(present, reduced, strict=True):
            out[i] = r
        return out


class _DistributedLossScaleMixin(_DistributedOptimizerMixin):
    """Placed in front of ``keras.optimizers.LossScaleOptimizer`` (see the module docstring)."""

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        if trainable_variables is not None:
            self.__dict__["_hvd_apply_vars"] = list(trainable_variables)
        elif self.built:
            self.__dict__["_hvd_apply_vars"] = list(self._trainable_variables)
        if not self.__dict__.get("_hvd_pending_reduced"):  # else _compute_gradients reduced them
            grads = self._hvd_allreduce_gradients(list(grads), self.__dict__.get("_hvd_apply_vars") or [],
                                                  pass_factor=1.0)  # scaled; before the finiteness check
        return super().apply(grads, trainable_variables)

    def _clip_gradients(self, grads: Any) -> Any:
        return keras.optimizers.Optimizer._clip_gradients(self, grads)  # reduced once, in apply


_class_cache: dict[tuple, type] = {}


def wrap_optimizer_class(base: type, compression: Any = None,
                         op: ReduceOp = common.Average, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, *,
                         ops: Callable[[], tuple[Any, Any]]) -> type:
    """The distributed subclass of Keras optimizer class ``base`` (cached, so equal settings give one class), reducing
    with the binding's collectives ``ops``."""
    if not (isinstance(base, type) and issubclass(base, keras.optimizers.Optimizer)):
        raise TypeError(f"expected a keras.optimizers.Optimizer subclass, got {base!r}")
    if issubclass(base, _DistributedOptimizerMixin):
        return base
    rop = common.resolve_op(op)
    if rop not in (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM):
        raise ValueError(f"DistributedOptimizer supports op=Average, Sum or Adasum, got {rop}")
    prescale, postscale = common.gradient_scales(rop, gradient_predivide_factor)
    loss_scale = issubclass(base, keras.optimizers.LossScaleOptimizer)
    if rop is ReduceOp.ADASUM and average_aggregated_gradients:
        raise ValueError("Adasum does not support average_aggregated_gradients == True")  # Horovod's words
    if rop is ReduceOp.ADASUM and loss_scale:
        raise NotImplementedError("DistributedOptimizer(op=Adasum) with loss scaling (LossScaleOptimizer / "
                                  "mixed_float16) is not supported: use mixed_bfloat16 or float32, or op=Average")
    key = (base, compression, rop, prescale, postscale, bool(average_aggregated_gradients), ops)
    cls = _class_cache.get(key)
    if cls is None:
        mixins: tuple[type, ...] = ((_DistributedLossScaleMixin,) if loss_scale
                                    else (DeltaAdasumMixin, _DistributedOptimizerMixin) if rop is ReduceOp.ADASUM
                                    else (_DistributedOptimizerMixin,))
        cls = type(base.__name__, (*mixins, base), {
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "__doc__": base.__doc__,
            "_hvd_compression": compression,
            "_hvd_ops": staticmethod(ops),
            "_hvd_op": rop,
            "_hvd_prescale": prescale,
            "_hvd_postscale": postscale,
            "_hvd_average_aggregated": bool(average_aggregated_gradients),
            **compat.iterations_members(base),  # ``iterations`` counts passes, as Horovod's
        })
        _class_cache[key] = cls
    return cls


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer,  # noqa: N802 - Horovod's name
                         name: str | None = None,
                         device_dense: str = "",
                         device_sparse: str = "",
                         compression: Any = None,
                         sparse_as_dense: bool = True,
                         gradient_predivide_factor: float = 1.0,
                         op: ReduceOp = common.Average,
                         backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False,
                         num_groups: int = 0,
                         groups: Any = None,
                         process_set: Any = None,
                         scale_local_gradients: bool = True, *,
                         ops: Callable[[], tuple[Any, Any]]) -> keras.optimizers.Optimizer:
    """Wrap a Keras 3 optimizer so that ``model.fit`` applies gradients averaged over all ranks.

    The arguments are Horovod's, in Horovod's order:

    Args:
        optimizer: a ``keras.optimizers.Optimizer`` (Adam, SGD, ... or a subclass of your own).
        name: a name for the new optimizer (default: the wrapped one's).
        device_dense, device_sparse: Horovod's device placement of the collective ops; no effect here (the
            collectives run in spark_hvd's engine, GPU tensors through its NCCL backend). Accepted so scripts run.
        compression: ``hvd.Compression.none`` (default) or ``hvd.Compression.fp16`` (send gradients as float16).
        sparse_as_dense: sparse gradients (``IndexedSlices``) are always sent dense; ``False`` is accepted too
            (Horovod would allgather them instead: the update is the same).
        gradient_predivide_factor: divide before the sum and multiply after (Average only).
        op: ``Average`` (default) or ``Sum``, or ``Adasum``: the delta optimizer (each rank applies its own
            gradients, the variables' changes are combined with Adasum; see
            :mod:`spark_hvd._keras_common.adasum_optimizer`).
        backward_passes_per_step: accumulate this many batches' gradients locally (Keras's
            ``gradient_accumulation_steps``) before one allreduce and one update; ``iterations`` counts passes
            (Horovod's).
        average_aggregated_gradients: with ``backward_passes_per_step > 1``, whether the update uses the average
            of the accumulated passes (``True``) or their sum (``False``, Horovod's default).
        num_groups, groups: how Horovod splits the gradients into grouped allreduces. Here every step's gradients
            go out as one grouped collective that the engine fuses, so grouping changes no result; the values are
            checked (``num_groups >= 0``; ``groups`` an int or a list of variable lists) and otherwise unused.
        process_set: reduce over the ranks of this registered process set only (averages divide by its size; a
            rank outside it applies its own gradients, as in Horovod). ``None``: the whole job.
        scale_local_gradients: divide the gradients of variables registered with ``register_local_var`` (or
            :func:`PartialDistributedOptimizer`'s ``local_layers``) by ``size`` (True, Horovod's default).
        ops: the binding's collectives (given by ``spark_hvd.keras`` and ``spark_hvd.tensorflow``, not by users).

    Mixed precision: under ``mixed_bfloat16`` nothing changes. Under ``mixed_float16`` (the global policy,
    ``keras.mixed_precision.set_global_policy``) a plain optimizer comes back wrapped in a
    ``LossScaleOptimizer`` (what ``compile`` would do), and a ``LossScaleOptimizer`` passed in is kept: either way
    the scaled gradients are reduced once, before the loss scale's inf/nan check, so all ranks skip the same steps
    and keep the same scale (``backward_passes_per_step`` must then be 1: ``LossScaleOptimizer`` has no gradient
    accumulation). A model given ``dtype="mixed_float16"`` under another global policy would be wrapped by
    ``compile`` around the distributed optimizer, where the ranks could disagree on a skip: pass a
    ``LossScaleOptimizer`` here yourself in that case.

    Compile the model with ``jit_compile=False`` on GPU hosts (the collective cannot run inside XLA).
    The new optimizer is built from ``optimizer.get_config()``; a wrapped optimizer that was already built has
    its variables (iterations, moments) copied over.
    """
    common.require_init("DistributedOptimizer()")
    del device_dense, device_sparse, sparse_as_dense  # no effect here (see the docstring)
    if not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups must be an int >= 0, got {num_groups!r}")
    if groups is not None and not (isinstance(groups, int) and groups > 0) and not isinstance(groups, (list, tuple)):
        raise ValueError(f"groups must be a positive int or a list of lists of variables, got {groups!r}")
    if process_set is not None and not isinstance(process_set, common.ProcessSet):
        raise TypeError(f"DistributedOptimizer(process_set=...) takes a ProcessSet, got {type(process_set).__name__}")
    if process_set is not None and process_set.process_set_id is None:
        raise ValueError(f"DistributedOptimizer(process_set={process_set}): register it with add_process_set() first")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    loss_scale = keras.optimizers.LossScaleOptimizer
    if keras.config.dtype_policy().name == "mixed_float16" and not isinstance(optimizer, loss_scale):
        optimizer = loss_scale(optimizer)  # what compile would do, here so that the gradients are reduced first
    if isinstance(optimizer, loss_scale):
        if isinstance(optimizer.inner_optimizer, _DistributedOptimizerMixin):
            raise ValueError("DistributedOptimizer: the LossScaleOptimizer wraps a DistributedOptimizer; wrap the "
                             "plain optimizer in LossScaleOptimizer, then that in DistributedOptimizer (the "
                             "gradients must be reduced before the loss scale checks them)")
        if backward_passes_per_step > 1:
            raise ValueError(f"DistributedOptimizer: backward_passes_per_step={backward_passes_per_step} with loss "
                             "scaling (LossScaleOptimizer / mixed_float16): LossScaleOptimizer has no gradient "
                             "accumulation; use 1, or mixed_bfloat16 (no loss scaling)")
    cls = wrap_optimizer_class(type(optimizer), compression, op, gradient_predivide_factor,
                               average_aggregated_gradients, ops=ops)
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    if backward_passes_per_step > 1:
        config["gradient_accumulation_steps"] = backward_passes_per_step
    new = cls.from_config(config)
    new._hvd_scale_local = bool(scale_local_gradients)
    new._hvd_process_set = process_set
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


def PartialDistributedOptimizer(optimizer: keras.optimizers.Optimizer,  # noqa: N802 - Horovod's name
                                name: str | None = None, local_layers: Any = None,
                                **kwargs: Any) -> keras.optimizers.Optimizer:
    """:func:`DistributedOptimizer` whose ``local_layers`` (a layer or a list of layers) keep their variables
    local to each rank: their gradients are not reduced (Horovod's). Other arguments are
    :func:`DistributedOptimizer`'s."""
    new = DistributedOptimizer(optimizer, name=name, **kwargs)
    layers = [] if local_layers is None else (local_layers if isinstance(local_layers, (list, tuple))
                                              else [local_layers])
    for layer in layers:
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(f"PartialDistributedOptimizer: local_layers must hold Keras layers, got "
                            f"{type(layer).__name__}")
        for var in layer.trainable_weights:
            new.register_local_var(var)
    return new
