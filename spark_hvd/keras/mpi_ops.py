"""Collectives on TensorFlow tensors over the core's numpy buffers.

Eagerly a tensor's ``.numpy()`` is handed to the core; inside a ``tf.function`` graph the same numpy code runs
through ``tf.numpy_function``. bfloat16 travels as a uint16 view with ``bfloat16=True``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from spark_hvd import _binding_common as common
from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.process_sets import ProcessSet, global_process_set
from spark_hvd.keras.compression import Compression, Compressor

log = logging.getLogger(__name__)


def init(*args: Any, **kwargs: Any) -> None:
    """Join the job (idempotent). Arguments go to :func:`spark_hvd.core.init`.

    On a host with GPUs, TensorFlow is limited to this rank's GPU (the one GPU policy,
    ``spark_hvd.core.jobenv.gpu_index``: the GPU Spark assigned, else the local rank) with memory growth, when
    TensorFlow has not initialised its devices yet and nobody chose its visible GPUs before (the KerasEstimator,
    or the user's own ``tf.config.set_visible_devices``, e.g. none for ``use_gpu=False``: left as chosen).
    """
    c = common.core()
    c.init(*args, **kwargs)
    try:
        gpus = tf.config.list_physical_devices("GPU")
        if gpus and len(tf.config.get_visible_devices("GPU")) == len(gpus):
            index = common.gpu_index(len(gpus))
            if index is not None:
                tf.config.experimental.set_memory_growth(gpus[index], True)
                tf.config.set_visible_devices(gpus[index], "GPU")
    except RuntimeError as e:  # devices already initialised by the user's code
        log.warning("could not pin this rank's GPU in TensorFlow (%s); pin it before any TF op runs", e)


def _host_copy(a: Any) -> np.ndarray:
    """A writable C-contiguous copy of a numpy_function input (TF owns the input memory)."""
    return np.array(a, copy=True, order="C")


def _run_numpy(fn: Callable[..., Any], inputs: Sequence[tf.Tensor], tout: Sequence[tf.DType],
               name: str) -> list[tf.Tensor]:
    """``fn`` on the numpy values of ``inputs``, eagerly or as a ``tf.numpy_function`` inside a graph."""
    if tf.executing_eagerly():
        outs = fn(*[t.numpy() for t in inputs])
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        return [tf.convert_to_tensor(o, dtype=d) for o, d in zip(outs, tout, strict=True)]
    outs = tf.numpy_function(fn, list(inputs), list(tout), stateful=True, name=name)
    return list(outs) if isinstance(outs, (list, tuple)) else [outs]


def _check_not_xla() -> None:
    try:
        from tensorflow.python.ops import control_flow_util

        in_xla = control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
    except Exception:  # noqa: BLE001 - private API moved: skip the check
        return
    if in_xla:
        raise RuntimeError("spark_hvd collectives cannot run inside an XLA-compiled function; compile the model "
                           "with model.compile(..., jit_compile=False)")


def allreduce(value: Any, name: str | None = None, average: bool | None = None,
              compression: type[Compressor] = Compression.none, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Reduce ``value`` across ranks (of ``process_set``; default: average); returns a new tensor of the same
    shape."""
    common.require_init("allreduce()")
    return grouped_allreduce([value], name=name, average=average, compression=compression, op=op,
                             prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                             process_set=process_set)[0]


def grouped_allreduce(values: Sequence[Any], name: str | None = None, average: bool | None = None,
                      compression: type[Compressor] = Compression.none, op: ReduceOp | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Reduce several tensors across ranks (of ``process_set``) in one collective (one per dtype family); returns
    new tensors."""
    common.require_init("grouped_allreduce()")
    common.check_member(process_set, "grouped_allreduce()")
    rop = common.resolve_op(op, average)
    tensors = [tf.convert_to_tensor(v) for v in values]
    if not tensors:
        return []
    _check_not_xla()
    pairs = [compression.compress(t) for t in tensors]
    sent = [p[0] for p in pairs]
    names = None if name is None else [f"{name}.{i}" for i in range(len(sent))]

    def fn(*arrays: np.ndarray) -> list[np.ndarray]:
        bufs = [_host_copy(a) for a in arrays]
        views = [common.to_core_buffer(b) for b in bufs]
        c = common.core()
        handles = []
        for flag in (False, True):
            idx = [i for i, v in enumerate(views) if v[1] == flag]
            if not idx:
                continue
            handles.append(c.grouped_allreduce_async(
                [views[i][0] for i in idx], names=None if names is None else [names[i] for i in idx],
                op=rop, prescale=prescale_factor, postscale=postscale_factor, bfloat16=flag,
                process_set=process_set))
        for h in handles:
            c.synchronize(h)
        return bufs

    outs = _run_numpy(fn, sent, [t.dtype for t in sent], "spark_hvd_grouped_allreduce")
    result = []
    for o, t, (_, ctx) in zip(outs, sent, pairs, strict=True):
        o = tf.ensure_shape(o, t.shape) if not tf.executing_eagerly() else o
        result.append(compression.decompress(o, ctx))
    return result


def allgather(value: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Every rank's (of ``process_set``) ``value`` concatenated on dimension 0 (which may differ by rank)."""
    common.require_init("allgather()")
    common.check_member(process_set, "allgather()")
    t = tf.convert_to_tensor(value)
    if t.shape.rank == 0:
        raise ValueError("allgather needs a tensor with at least one dimension")
    _check_not_xla()

    def fn(a: np.ndarray) -> np.ndarray:
        buf, _ = common.to_core_buffer(np.ascontiguousarray(a))
        out = common.core().synchronize(common.core().allgather_async(buf, name=name,
                                                                                process_set=process_set))
        return np.ascontiguousarray(out).view(a.dtype)

    out = _run_numpy(fn, [t], [t.dtype], "spark_hvd_allgather")[0]
    if not tf.executing_eagerly():
        out.set_shape([None] + t.shape.as_list()[1:])
    return out


def broadcast(value: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Root's ``value`` (``root_rank`` a global rank), as a new tensor on every rank (of ``process_set``)."""
    common.require_init("broadcast()")
    common.check_member(process_set, "broadcast()")
    t = tf.convert_to_tensor(value)
    _check_not_xla()

    def fn(a: np.ndarray) -> np.ndarray:
        buf = _host_copy(a)
        view, _ = common.to_core_buffer(buf)
        common.core().synchronize(common.core().broadcast_async(view, root_rank, name=name,
                                                                          process_set=process_set))
        return buf

    out = _run_numpy(fn, [t], [t.dtype], "spark_hvd_broadcast")[0]
    if not tf.executing_eagerly():
        out.set_shape(t.shape)
    return out


def alltoall(value: Any, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[i]`` rows of ``value`` to rank i (even split when None); returns the rows received in rank
    order, and with ``splits`` given ``(output, received_splits)`` as in Horovod."""
    common.require_init("alltoall()")
    common.check_member(process_set, "alltoall()")
    t = tf.convert_to_tensor(value)
    _check_not_xla()
    split_list = None
    if splits is not None:
        split_list = [int(x) for x in (splits.numpy() if hasattr(splits, "numpy") else splits)]

    def fn(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        buf, _ = common.to_core_buffer(np.ascontiguousarray(a))
        out, rsplits = common.core().synchronize(common.core().alltoall_async(buf, splits=split_list, name=name,
                                                                              process_set=process_set))
        return np.ascontiguousarray(out).view(a.dtype), np.asarray(rsplits, dtype=np.int32)

    out, rsplits = _run_numpy(fn, [t], [t.dtype, tf.int32], "spark_hvd_alltoall")
    if not tf.executing_eagerly():
        out.set_shape([None] + t.shape.as_list()[1:])
    return out if splits is None else (out, rsplits)


def reducescatter(value: Any, name: str | None = None, op: ReduceOp | None = None,
                  average: bool | None = None, process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Reduce ``value`` across ranks and return this rank's rows of the result (first ``rows % size`` ranks
    get one row more)."""
    common.require_init("reducescatter()")
    common.check_member(process_set, "reducescatter()")
    rop = common.resolve_op(op, average)
    t = tf.convert_to_tensor(value)
    _check_not_xla()

    def fn(a: np.ndarray) -> np.ndarray:
        bf16 = common.is_bfloat16_dtype(a.dtype)
        # the core's reducescatter has no bfloat16 mode: reduce in float32, round at the end
        buf = np.asarray(a, dtype=np.float32) if bf16 else _host_copy(a)
        buf = np.array(buf, copy=True, order="C")
        out = common.core().synchronize(common.core().reducescatter_async(buf, op=rop, name=name,
                                                                              process_set=process_set))
        return np.ascontiguousarray(out).astype(a.dtype, copy=False)

    out = _run_numpy(fn, [t], [t.dtype], "spark_hvd_reducescatter")[0]
    if not tf.executing_eagerly():
        out.set_shape([None] + t.shape.as_list()[1:])
    return out
