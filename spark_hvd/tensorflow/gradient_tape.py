"""``DistributedGradientTape``: a ``tf.GradientTape`` whose ``gradient()`` comes back averaged over the ranks.

The wrapper holds the user's tape and hands everything but ``gradient`` to it, so it works recorded before
(``tape = hvd.DistributedGradientTape(tape)`` after the ``with`` block) or around it
(``with hvd.DistributedGradientTape(tf.GradientTape()) as tape:``), eagerly and inside ``tf.function``. One step's
gradients go out as one grouped allreduce, which the engine fuses. Sources registered as local
(``register_local_source``, or ``PartialDistributedGradientTape``'s ``local_layers``) are not reduced, only divided
by the set's size when ``scale_local_gradients`` (Horovod's default).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from spark_hvd import _binding_common as common
from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.process_sets import ProcessSet, global_process_set
from spark_hvd.tensorflow import collectives, mpi_ops
from spark_hvd.tensorflow.compression import Compression, Compressor


def reduce_gradients(grads: Sequence[Any], sources: Sequence[Any], *, compression: type[Compressor],
                     sparse_as_dense: bool, op: ReduceOp, gradient_predivide_factor: float,
                     process_set: ProcessSet, local_ids: set[int], scale_local: bool,
                     name: str | None = None) -> list[Any]:
    """``grads`` (of ``sources``) reduced over ``process_set`` in one grouped collective; ``None`` stays None,
    the gradients of local sources are only scaled. A rank outside the set gets its own gradients back."""
    grads = list(grads)
    if process_set.process_set_id not in (None, 0) and not process_set.included():
        return grads
    size = mpi_ops.set_size(process_set)
    out: list[Any] = list(grads)
    local = [i for i, s in enumerate(sources) if id(s) in local_ids and grads[i] is not None]
    for i in local:
        if scale_local and size > 1:
            g = grads[i]
            if isinstance(g, tf.IndexedSlices):
                out[i] = tf.IndexedSlices(g.values / tf.cast(size, g.values.dtype), g.indices, g.dense_shape)
            else:
                out[i] = g / tf.cast(size, g.dtype)
    present = [i for i, g in enumerate(grads) if g is not None and i not in local]
    if size == 1 or not present:
        return out
    prescale, postscale = common.gradient_scales(op, gradient_predivide_factor)
    values = [tf.convert_to_tensor(grads[i]) if sparse_as_dense and isinstance(grads[i], tf.IndexedSlices)
              else grads[i] for i in present]
    # named by the count: a rank that ran extra batches before join() keeps its unnamed ops' counters in step
    reduced = collectives.grouped_allreduce(values, compression=compression, op=op, prescale_factor=prescale,
                                            postscale_factor=postscale, process_set=process_set,
                                            name=name or f"DistributedGradientTape.{len(values)}grads")
    for i, r in zip(present, reduced, strict=True):
        out[i] = r
    return out


class DistributedGradientTape:
    """Horovod's ``hvd.DistributedGradientTape(tape, ...)``: see :func:`spark_hvd.tensorflow.DistributedGradientTape`
    for the arguments. Everything but ``gradient`` is the wrapped tape's."""

    def __init__(self, gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                 compression: type[Compressor] = Compression.none, sparse_as_dense: bool = False,
                 op: ReduceOp = common.Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 groups: Any = None, process_set: ProcessSet = global_process_set,
                 scale_local_gradients: bool = True) -> None:
        common.require_init("DistributedGradientTape()")
        del device_dense, device_sparse  # no effect here: the engine places the collective
        if not isinstance(gradtape, tf.GradientTape):
            raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(gradtape).__name__}")
        rop = common.resolve_op(op)
        if rop not in (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM):
            raise ValueError(f"DistributedGradientTape supports op=Average, Sum or Adasum, got {rop}")
        if not isinstance(num_groups, int) or num_groups < 0:
            raise ValueError(f"num_groups must be an int >= 0, got {num_groups!r}")
        if groups is not None and not (isinstance(groups, int) and groups > 0) and \
                not isinstance(groups, (list, tuple)):
            raise ValueError(f"groups must be a positive int or a list of lists of variables, got {groups!r}")
        common.gradient_scales(rop, gradient_predivide_factor)  # checks the factor now
        if process_set.process_set_id is None:
            raise ValueError(f"DistributedGradientTape(process_set={process_set}): register it with add_process_set() "
                             "first")
        self._tape = gradtape
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._op = rop
        self._predivide = gradient_predivide_factor
        self._process_set = process_set
        self._scale_local = scale_local_gradients
        self._local_ids: dict[int, Any] = {}

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._tape.__exit__(*exc)

    def __getattr__(self, attr: str) -> Any:  # watch, stop_recording, reset, jacobian, ...: the wrapped tape's
        return getattr(self.__dict__["_tape"], attr)

    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient local to this rank (not reduced; divided by size when
        ``scale_local_gradients``)."""
        self._local_ids[id(source)] = source  # kept, so that its id stays unique

    def register_local_sources(self, sources: Sequence[Any]) -> None:
        """:meth:`register_local_source` for each of ``sources``."""
        for s in sources:
            self.register_local_source(s)

    def _reduce(self, grads: Sequence[Any], sources: Sequence[Any]) -> list[Any]:
        return reduce_gradients(grads, sources, compression=self._compression, sparse_as_dense=self._sparse_as_dense,
                                op=self._op, gradient_predivide_factor=self._predivide,
                                process_set=self._process_set, local_ids=set(self._local_ids),
                                scale_local=self._scale_local)

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE, use_generic_names: bool = False) -> Any:
        """The wrapped tape's gradients of ``target`` w.r.t. ``sources`` (any nest), reduced over the ranks."""
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients,
                                    unconnected_gradients=unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat = self._reduce(tf.nest.flatten(grads, expand_composites=False), flat_sources)
        return tf.nest.pack_sequence_as(grads, flat) if tf.nest.is_nested(grads) else flat[0]


class PartialDistributedGradientTape(DistributedGradientTape):
    """:class:`DistributedGradientTape` whose ``local_layers`` keep their gradients local (Horovod's)."""

    def __init__(self, gradtape: tf.GradientTape, local_layers: Any = None, **kwargs: Any) -> None:
        super().__init__(gradtape, **kwargs)
        layers = [] if local_layers is None else (local_layers if isinstance(local_layers, (list, tuple))
                                                  else [local_layers])
        for layer in layers:
            if not hasattr(layer, "trainable_weights"):
                raise TypeError(f"PartialDistributedGradientTape: local_layers must hold Keras layers, got "
                                f"{type(layer).__name__}")
            self.register_local_sources(layer.trainable_weights)

    def get_local_and_global_gradients(self, target: Any, sources: Sequence[Any], output_gradients: Any = None,
                                       use_generic_names: bool = False) -> tuple[list[tuple[Any, Any]],
                                                                                 list[tuple[Any, Any]]]:
        """``([(local source, its gradient), ...], [(global source, its reduced gradient), ...])``."""
        sources = list(sources)
        grads = self.gradient(target, sources, output_gradients=output_gradients)
        local = [(s, g) for s, g in zip(sources, grads, strict=True) if id(s) in self._local_ids]
        shared = [(s, g) for s, g in zip(sources, grads, strict=True) if id(s) not in self._local_ids]
        return local, shared
