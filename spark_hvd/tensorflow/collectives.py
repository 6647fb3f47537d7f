"""Horovod's TensorFlow collectives, differentiable, eagerly and inside ``tf.function`` (or a TF1 graph).

Gradients are Horovod's (``tf.custom_gradient`` around the raw ops of ``mpi_ops``):

============================  =========================================================================
forward                       gradient (``g``: the gradient of this rank's output)
============================  =========================================================================
allreduce, grouped_allreduce  the same allreduce of ``g`` (same op, prescale and postscale)
allgather, grouped_allgather  this rank's rows of the *average* over ranks of ``g``
broadcast                     on the root: the average over ranks of ``g``; elsewhere zeros
alltoall                      ``g`` sent back where it came from (alltoall with the received splits)
reducescatter (+ grouped)     allgather of ``g``, times ``size`` for Sum, times prescale and postscale
============================  =========================================================================

``tf.IndexedSlices`` (sparse gradients) are allreduced as Horovod does: their values and indices are allgathered
(``Sum``), the values divided by the set's size (``Average``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from spark_hvd import _binding_common as common
from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.process_sets import ProcessSet, global_process_set
from spark_hvd.tensorflow import mpi_ops
from spark_hvd.tensorflow.compression import Compression, Compressor


def _recording() -> bool:
    """False when no gradient tape could record this op (eager, no tape active): the op then skips
    ``tf.custom_gradient``, which costs about a millisecond per eager call."""
    if not tf.executing_eagerly():
        return True
    try:
        from tensorflow.python.eager import record

        return bool(record.could_possibly_record())
    except Exception:  # noqa: BLE001 - private API moved: always wrap
        return True


def _names(kind: str, name: str | None, tensors: Sequence[Any]) -> list[str | None]:
    """One name per tensor: ``name`` (graph: Horovod's generated name) itself for one tensor, ``<name>.<i>`` for
    a group."""
    base = mpi_ops.op_name(kind, name, tensors)
    return [base] if len(tensors) == 1 else mpi_ops.member_names(base, len(tensors))


def _zeros_for(dys: Sequence[Any], xs: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    return [tf.zeros_like(x) if dy is None else tf.convert_to_tensor(dy) for dy, x in zip(dys, xs, strict=True)]


def _differentiable(run: Callable[[list[tf.Tensor]], list[tf.Tensor]],
                    gradient: Callable[[Sequence[Any], Sequence[tf.Tensor], Any], list[tf.Tensor]],
                    tensors: list[tf.Tensor]) -> list[tf.Tensor]:
    """``run(tensors)`` (a raw op of ``mpi_ops`` on a list); where a gradient tape may record it (``_recording``),
    inside a ``tf.custom_gradient`` whose gradient of the upstream ``dys`` is ``gradient(dys, xs, outs)``."""
    if not _recording():
        return run(tensors)

    @tf.custom_gradient
    def fn(*xs: tf.Tensor) -> Any:
        outs = run(list(xs))

        def grad(*dys: Any) -> list[tf.Tensor]:
            return gradient(dys, xs, outs)
        return outs, grad

    out = fn(*tensors)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _allreduce_diff(tensors: list[tf.Tensor], name: str | None, op: ReduceOp, prescale: float, postscale: float,
                    process_set: ProcessSet) -> list[tf.Tensor]:
    names = _names("GroupedAllreduce" if len(tensors) > 1 else "Allreduce", name, tensors)
    return _differentiable(
        lambda xs: mpi_ops.allreduce_raw(xs, names, op, prescale, postscale, process_set),
        lambda dys, xs, _outs: _allreduce_diff(_zeros_for(dys, xs), None, op, prescale, postscale, process_set),
        tensors)


def _sparse_allreduce(value: tf.IndexedSlices, op: ReduceOp, prescale: float, postscale: float,
                      process_set: ProcessSet, name: str | None) -> tf.IndexedSlices:
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise NotImplementedError(f"allreduce of tf.IndexedSlices supports op=Average or op=Sum, got {op}")
    if prescale != 1.0 or postscale != 1.0:
        raise NotImplementedError("prescale_factor / postscale_factor are not supported with tf.IndexedSlices")
    values, indices = _allgather_diff([value.values, value.indices], None if name is None else f"{name}.sparse",
                                      process_set)
    if op is ReduceOp.AVERAGE:
        values = values / tf.cast(mpi_ops.set_size(process_set), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=value.dense_shape)


def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "", device_sparse: str = "",
              compression: type[Compressor] = Compression.none, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, name: str | None = None,
              process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False) -> Any:
    """Reduce ``tensor`` (a ``tf.Tensor``, ``tf.Variable`` or ``tf.IndexedSlices``) across the ranks of
    ``process_set`` (default: average); returns a new tensor of the same shape.

    ``op``: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product``; ``prescale_factor`` multiplies the
    input, ``postscale_factor`` the result; ``compression=Compression.fp16`` sends floats as float16.
    ``device_dense``, ``device_sparse`` and ``ignore_name_scope`` are accepted for Horovod compatibility.
    """
    mpi_ops.require_init("allreduce()")
    del device_dense, device_sparse, ignore_name_scope
    rop = common.resolve_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(tensor, rop, prescale_factor, postscale_factor, process_set, name)
    t = tf.convert_to_tensor(tensor)
    compressed, ctx = compression.compress(t)
    out = _allreduce_diff([compressed], name, rop, prescale_factor, postscale_factor, process_set)[0]
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None, device_dense: str = "",
                      device_sparse: str = "", compression: type[Compressor] = Compression.none,
                      op: ReduceOp | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
                      name: str | None = None) -> list[Any]:
    """Reduce several tensors across ranks as one collective (fused by the engine); ``tf.IndexedSlices`` among
    them are allgathered as in :func:`allreduce`. Returns new tensors in the same order."""
    mpi_ops.require_init("grouped_allreduce()")
    del device_dense, device_sparse, ignore_name_scope
    rop = common.resolve_op(op, average)
    tensors = list(tensors)
    if not tensors:
        return []
    out: list[Any] = [None] * len(tensors)
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    sparse = [i for i in range(len(tensors)) if i not in dense]
    for i in sparse:
        out[i] = _sparse_allreduce(tensors[i], rop, prescale_factor, postscale_factor, process_set,
                                   None if name is None else f"{name}.{i}")
    if dense:
        pairs = [compression.compress(tf.convert_to_tensor(tensors[i])) for i in dense]
        reduced = _allreduce_diff([p[0] for p in pairs], name, rop, prescale_factor, postscale_factor, process_set)
        for i, r, (_, ctx) in zip(dense, reduced, pairs, strict=True):
            out[i] = compression.decompress(r, ctx)
    return out


def _allgather_diff(tensors: list[tf.Tensor], name: str | None, process_set: ProcessSet) -> list[tf.Tensor]:
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    names = _names("Allgather", name, tensors)

    def grad(dys: Sequence[Any], xs: Sequence[tf.Tensor], outs: Any) -> list[tf.Tensor]:
        dys = _zeros_for(dys, outs)
        reduced = [mpi_ops.allreduce_raw([d], [mpi_ops.op_name("Allreduce", None, [d])], ReduceOp.AVERAGE,
                                         1.0, 1.0, process_set)[0] for d in dys]
        rows = [tf.reshape(tf.shape(x, out_type=tf.int32)[0], [1]) for x in xs]
        counts = mpi_ops.allgather_raw(rows, [mpi_ops.op_name("Allgather", None, [r]) for r in rows], process_set)
        r = mpi_ops.set_rank(process_set)
        res = []
        for g, c in zip(reduced, counts, strict=True):
            start = tf.reduce_sum(c[:r])
            res.append(g[start:start + c[r]])
        return res

    return _differentiable(lambda xs: mpi_ops.allgather_raw(xs, names, process_set), grad, tensors)


def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Every rank's (of ``process_set``) ``tensor`` concatenated on dimension 0, which may differ by rank."""
    mpi_ops.require_init("allgather()")
    return _allgather_diff([tensor], name, process_set)[0]


def grouped_allgather(tensors: Sequence[Any], name: str | None = None, ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """:func:`allgather` of each of ``tensors``, submitted together."""
    mpi_ops.require_init("grouped_allgather()")
    tensors = list(tensors)
    return _allgather_diff(tensors, name, process_set) if tensors else []


def broadcast(tensor: Any, root_rank: int, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Root's ``tensor`` (``root_rank`` a global rank), as a new tensor on every rank of ``process_set``."""
    mpi_ops.require_init("broadcast()")
    t = tf.convert_to_tensor(tensor)
    op_name = mpi_ops.op_name("Broadcast", name, [t])
    if not _recording():
        return mpi_ops.broadcast_raw(t, root_rank, op_name, process_set)

    @tf.custom_gradient
    def fn(x: tf.Tensor) -> Any:
        out = mpi_ops.broadcast_raw(x, root_rank, op_name, process_set)

        def grad(dy: Any) -> tf.Tensor:
            dy = _zeros_for([dy], [out])[0]
            g = mpi_ops.allreduce_raw([dy], [mpi_ops.op_name("Allreduce", None, [dy])], ReduceOp.AVERAGE, 1.0, 1.0,
                                      process_set)[0]
            return g if common.rank() == root_rank else g * 0
        return out, grad

    return fn(t)


def broadcast_(variables: Any, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> Any:
    """Assign root's values to ``variables`` (one ``tf.Variable`` or a list) in place; returns their new values
    (a tensor, or a list for a list)."""
    mpi_ops.require_init("broadcast_()")
    single = not isinstance(variables, (list, tuple))
    variables = [variables] if single else list(variables)
    names = mpi_ops.member_names(name, len(variables))
    values = []
    for v, n in zip(variables, names, strict=True):
        value = mpi_ops.broadcast_raw(tf.convert_to_tensor(v), root_rank,
                                      mpi_ops.op_name("Broadcast", n, [v]) if n is None else n, process_set)
        values.append(v.assign(value).read_value() if tf.executing_eagerly() else v.assign(value))
    return values[0] if single else values


def alltoall(tensor: Any, splits: Any = None, name: str | None = None, ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[i]`` rows of ``tensor`` to rank i of ``process_set`` (an even split when None); returns
    the rows received in rank order, and with ``splits`` given ``(rows, received splits)``, as Horovod."""
    mpi_ops.require_init("alltoall()")
    t = tf.convert_to_tensor(tensor)
    op_name = mpi_ops.op_name("Alltoall", name, [t])
    if splits is not None:
        splits = tf.convert_to_tensor(splits)
        if not splits.dtype.is_integer:
            raise ValueError(f"alltoall splits must be an integer tensor (tf.int32), got {splits.dtype.name}")

    def run(x: tf.Tensor, s: Any) -> Any:
        @tf.custom_gradient
        def fn(x: tf.Tensor) -> Any:
            out, rsplits = mpi_ops.alltoall_raw(x, s, op_name, process_set)

            def grad(dy: Any, _dsplits: Any = None) -> tf.Tensor:
                dy = _zeros_for([dy], [out])[0]
                return mpi_ops.alltoall_raw(dy, rsplits, mpi_ops.op_name("Alltoall", None, [dy]), process_set)[0]
            return (out, rsplits), grad
        return fn(x)

    out, rsplits = run(t, splits) if _recording() else mpi_ops.alltoall_raw(t, splits, op_name, process_set)
    return (out, rsplits) if splits is not None else out


def _reducescatter_diff(tensors: list[tf.Tensor], name: str | None, op: ReduceOp, prescale: float,
                        postscale: float, process_set: ProcessSet) -> list[tf.Tensor]:
    names = _names("Reducescatter", name, tensors)

    def grad(dys: Sequence[Any], _xs: Sequence[tf.Tensor], outs: Any) -> list[tf.Tensor]:
        factor = (mpi_ops.set_size(process_set) if op is ReduceOp.SUM else 1.0) * prescale * postscale
        dys = [d * tf.cast(factor, d.dtype) if factor != 1.0 else d for d in _zeros_for(dys, outs)]
        return mpi_ops.allgather_raw(dys, [mpi_ops.op_name("Allgather", None, [d]) for d in dys], process_set)

    return _differentiable(lambda xs: mpi_ops.reducescatter_raw(xs, names, op, prescale, postscale, process_set),
                           grad, tensors)


def reducescatter(tensor: Any, device_dense: str = "", compression: type[Compressor] = Compression.none,
                  op: ReduceOp | None = None, name: str | None = None,
                  process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduce ``tensor`` across ranks (``Average`` by default, or ``Sum``) and return this rank's rows of the
    result (the first ``rows % size`` ranks get one row more)."""
    mpi_ops.require_init("reducescatter()")
    rop = common.resolve_op(op)
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    out = _reducescatter_diff([compressed], name, rop, prescale_factor, postscale_factor, process_set)[0]
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "",
                          compression: type[Compressor] = Compression.none, op: ReduceOp | None = None,
                          name: str | None = None, process_set: ProcessSet = global_process_set,
                          ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[tf.Tensor]:
    """:func:`reducescatter` of each of ``tensors``, submitted together."""
    mpi_ops.require_init("grouped_reducescatter()")
    rop = common.resolve_op(op)
    tensors = list(tensors)
    if not tensors:
        return []
    pairs = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
    outs = _reducescatter_diff([p[0] for p in pairs], name, rop, prescale_factor, postscale_factor, process_set)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs, strict=True)]
