"""TensorFlow tensors in and out of the core's engine: the raw (not differentiable) collectives.

Eagerly a tensor's numpy value is handed to the core; inside a graph (``tf.function`` or a TF1 graph) the same
numpy code runs in a stateful ``tf.numpy_function``. bfloat16 travels as a uint16 view with ``bfloat16=True``.

Names: an eager op without a name takes the engine's per-kind counter (the same on every rank that calls in the
same order). A graph op without one gets a name fixed when the graph is built, ``Horovod<Kind>`` made unique in its
graph, the same on every rank that builds the same graph.

Order: a collective blocks the TensorFlow thread that runs it until every rank has submitted it, so ranks must start
a graph's collectives in one order, or a rank's threads could all wait on collectives that the other ranks have not
started. Inside ``tf.function`` TensorFlow's automatic control dependencies run stateful ops in program order. In a
TF1 graph each collective gets a control dependency on the one built before it in the same graph, so fetching a
collective also runs the ones built before it (the same on every rank).

Devices: eagerly, a tensor on a GPU goes to the device group by DLPack, without a copy through host memory
(``spark_hvd.tensorflow.device``: allreduce, allgather, broadcast); alltoall and reducescatter stage it through
host memory.

Errors: a tensor whose shape, dtype or root differs between ranks raises ``tf.errors.FailedPreconditionError``
(Horovod's), bad arguments found by the engine (alltoall splits) ``tf.errors.InvalidArgumentError``, eagerly and
inside a graph; the message names the tensor and the ranks. (Inside a graph TensorFlow turns any exception of a
``numpy_function`` into ``UnknownError``, ``ValueError`` into ``InvalidArgumentError``; so there a mismatch comes
out of the ``numpy_function`` as a message, and a graph op that fails with ``FailedPreconditionError`` carrying it
runs before the outputs are used: ``_raise_in_graph``.)
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from spark_hvd import _binding_common as common
from spark_hvd._binding_common import set_rank, set_size  # noqa: F401 - used as mpi_ops.set_rank / set_size
from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.errors import NotInitializedError, TensorMismatchError
from spark_hvd.core.process_sets import ProcessSet, global_process_set
from spark_hvd.tensorflow import device, host_memory

log = logging.getLogger(__name__)

_LAST_OP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # TF1 graph -> its last collective op


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
    """A writable C-contiguous copy (TF owns the memory of an input), aligned so that the result can go back to
    TensorFlow without a copy (``host_memory``)."""
    return host_memory.writable_copy(np.asarray(a))


def op_name(kind: str, name: str | None, tensors: Sequence[Any]) -> str | None:
    """The collective's name: ``name`` as given; eagerly None (the engine's counter); in a graph
    ``Horovod<Kind>`` made unique in the graph being built (Horovod appends the input's name, but inside
    ``tf.function`` a captured tensor's name differs between ranks)."""
    if name is not None or tf.executing_eagerly():
        return name
    return "tf." + tf.compat.v1.get_default_graph().unique_name(f"Horovod{kind}", mark_as_used=True)


def member_names(name: str | None, count: int) -> list[str | None]:
    return [None] * count if name is None else [f"{name}.{i}" for i in range(count)]


def _check_not_xla() -> None:
    try:
        from tensorflow.python.ops import control_flow_util

        in_xla = control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
    except Exception:  # noqa: BLE001 - private API moved: skip the check
        return
    if in_xla:
        raise RuntimeError("spark_hvd collectives cannot run inside an XLA-compiled function; compile the model "
                           "with model.compile(..., jit_compile=False) or tf.function(jit_compile=False)")


def run_numpy(fn: Callable[..., Any], inputs: Sequence[tf.Tensor], tout: Sequence[tf.DType],
              kind: str, owned: bool = False) -> list[tf.Tensor]:
    """``fn`` on the numpy values of ``inputs``, eagerly or as a stateful ``tf.numpy_function`` in a graph.

    Eagerly ``fn`` gets views of the tensors' memory (it must not write to them), and with ``owned`` (``fn``
    returns new buffers that nothing else holds) its results become tensors over the same memory where TensorFlow
    can take them (``host_memory``)."""
    if tf.executing_eagerly():
        try:
            outs = fn(*[host_memory.view(t) for t in inputs])
        except TensorMismatchError as e:
            raise tf.errors.FailedPreconditionError(None, None, str(e)) from e
        except ValueError as e:  # bad arguments found by the engine (splits, root rank): as inside a graph
            raise tf.errors.InvalidArgumentError(None, None, str(e)) from e
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        return [host_memory.to_tensor(o, d, owned) for o, d in zip(outs, tout, strict=True)]
    _check_not_xla()
    graph = tf.compat.v1.get_default_graph()
    tout = list(tout)

    def guarded(*arrays: np.ndarray) -> list[np.ndarray]:
        try:
            if not common.core().is_initialized():  # a graph built before init(), run without it
                raise NotInitializedError(f"{kind}()")
            outs = fn(*arrays)
        except (TensorMismatchError, NotInitializedError) as e:  # placeholders, never used: the error op fails
            return [np.zeros(0, t.as_numpy_dtype) for t in tout] + [np.bytes_(str(e).encode())]
        return [*(outs if isinstance(outs, (list, tuple)) else [outs]), np.bytes_(b"")]

    if getattr(graph, "building_function", False):  # tf.function: its automatic control dependencies order
        outs = tf.numpy_function(guarded, list(inputs), [*tout, tf.string], stateful=True, name=f"spark_hvd_{kind}")
    else:  # a TF1 graph: run the collectives in the order they were built (see the module docstring)
        last = _LAST_OP.get(graph)
        with tf.control_dependencies([last] if last is not None else []):
            outs = tf.numpy_function(guarded, list(inputs), [*tout, tf.string], stateful=True,
                                     name=f"spark_hvd_{kind}")
    outs = list(outs)
    check = _raise_in_graph(outs.pop())
    with tf.control_dependencies([check]):
        outs = [tf.identity(o) for o in outs]
    if not getattr(graph, "building_function", False):
        _LAST_OP[graph] = outs[0].op if outs else check.op
    return outs


def _raise_in_graph(message: tf.Tensor) -> tf.Tensor:
    """An op that fails with ``tf.errors.FailedPreconditionError`` carrying ``message`` when it is not empty.

    TensorFlow has no op that raises a chosen error class, and turns a ``numpy_function``'s exceptions into
    ``UnknownError``; reading a file under ``/dev/null`` fails with ``ENOTDIR``, which TensorFlow reports as
    ``FailedPreconditionError`` with the path, the message, in its text."""
    return tf.cond(tf.equal(message, ""), lambda: tf.constant(b""),
                   lambda: tf.io.read_file(tf.strings.join(["/dev/null/ spark_hvd: ", message, " (error) "])))


def require_init(what: str) -> None:
    """Raise :class:`NotInitializedError` naming ``what`` unless ``init()`` has been called, except while a TF1
    graph or a ``tf.function`` is being built: as in Horovod, such a graph may be built before ``init()``, and its
    collectives check when they run (``run_numpy``: ``FailedPreconditionError`` naming ``what``)."""
    if tf.executing_eagerly() or common.core().is_initialized():
        common.require_init(what)


def _check(process_set: ProcessSet | None, what: str) -> None:
    """``require_init``, then (where initialized) that this rank is a member of ``process_set``."""
    require_init(what)
    if common.core().is_initialized():
        common.check_member(process_set, what)


# ---------------------------------------------------------------------------------------------------- the ops

def allreduce_raw(tensors: Sequence[tf.Tensor], names: Sequence[str | None], op: ReduceOp, prescale: float,
                  postscale: float, process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Reduce ``tensors`` as one grouped collective (one per bfloat16 / other split); new tensors, same shapes."""
    _check(process_set, "allreduce()")
    if not tensors:
        return []
    if device.on_device_path(tensors):
        return device.allreduce(tensors, names, op, prescale, postscale, process_set)

    def fn(*arrays: np.ndarray) -> list[np.ndarray]:
        c = common.core()
        if (len(arrays) > 1 and len({a.dtype for a in arrays}) == 1 and op is not ReduceOp.ADASUM
                and not common.is_bfloat16_dtype(arrays[0].dtype)):
            # one dtype: packed into one buffer (the one copy needed anyway: TF's memory is read-only) and reduced
            # by one blocking call, the engine's fast path in a steady loop; the results are views of it (not for
            # Adasum: its coefficients are per tensor, so the engine must see the tensors apart)
            flat, views = common.packed(arrays)
            c.allreduce(flat, name=None if names[0] is None else f"{names[0]}.packed", op=op, prescale=prescale,
                        postscale=postscale, process_set=process_set)
            return views
        bufs = [_host_copy(a) for a in arrays]
        views = [common.to_core_buffer(b) for b in bufs]
        if len(views) == 1:  # the blocking call: the round runs in this thread (the engine's fast path)
            c.allreduce(views[0][0], name=names[0], op=op, prescale=prescale, postscale=postscale,
                        bfloat16=views[0][1], process_set=process_set)
            return bufs
        # mixed dtypes: every tensor queued without waking the engine thread; the first wait runs the round
        engine = c.get_engine(process_set)
        handles = [engine.enqueue("allreduce", v, n, op=op, prescale=prescale, postscale=postscale, bfloat16=flag,
                                  start_engine=False) for (v, flag), n in zip(views, names, strict=True)]
        for h in handles:
            h.wait()
        return bufs

    outs = run_numpy(fn, tensors, [t.dtype for t in tensors], "allreduce", owned=True)
    if not tf.executing_eagerly():
        outs = [tf.ensure_shape(o, t.shape) for o, t in zip(outs, tensors, strict=True)]
    return outs


def allgather_raw(tensors: Sequence[tf.Tensor], names: Sequence[str | None],
                  process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Every rank's tensors concatenated on dimension 0 (which may differ by rank), each tensor separately."""
    _check(process_set, "allgather()")
    if device.on_device_path(tensors):
        return device.allgather(tensors, names, process_set)
    for t in tensors:
        if t.shape.rank == 0:
            raise ValueError(f"allgather of {t.name if not tf.executing_eagerly() else 'a tensor'} needs a tensor "
                             "with at least one dimension, got a scalar (use tf.reshape(x, [1]))")

    def fn(*arrays: np.ndarray) -> list[np.ndarray]:
        c = common.core()
        handles = [c.allgather_async(common.to_core_buffer(np.ascontiguousarray(a))[0], name=n,
                                     process_set=process_set) for a, n in zip(arrays, names, strict=True)]
        return [np.ascontiguousarray(c.synchronize(h)).view(a.dtype) for h, a in zip(handles, arrays, strict=True)]

    outs = run_numpy(fn, tensors, [t.dtype for t in tensors], "allgather")
    if not tf.executing_eagerly():
        for o, t in zip(outs, tensors, strict=True):
            o.set_shape([None] + t.shape.as_list()[1:])
    return outs


def broadcast_raw(tensor: tf.Tensor, root_rank: int, name: str | None,
                  process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Root's ``tensor`` (``root_rank`` a global rank) as a new tensor on every rank (of ``process_set``)."""
    _check(process_set, "broadcast()")
    if device.on_device_path([tensor]):
        return device.broadcast(tensor, root_rank, name, process_set)

    def fn(a: np.ndarray) -> np.ndarray:
        buf = _host_copy(a)
        view, _ = common.to_core_buffer(buf)
        common.core().synchronize(common.core().broadcast_async(view, root_rank, name=name, process_set=process_set))
        return buf

    out = run_numpy(fn, [tensor], [tensor.dtype], "broadcast", owned=True)[0]
    if not tf.executing_eagerly():
        out.set_shape(tensor.shape)
    return out


def _splits_list(splits: Any) -> list[int] | None:
    if splits is None:
        return None
    arr = np.asarray(splits)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"alltoall splits must be integers (tf.int32 in Horovod), got {arr.dtype}")
    return [int(x) for x in arr.reshape(-1)]


def alltoall_raw(tensor: tf.Tensor, splits: Any, name: str | None,
                 process_set: ProcessSet = global_process_set) -> tuple[tf.Tensor, tf.Tensor]:
    """Send ``splits[i]`` rows of ``tensor`` to rank i of the set (even split when None); returns the rows
    received, in rank order, and the received splits (int32)."""
    _check(process_set, "alltoall()")
    if splits is not None and not isinstance(splits, (tf.Tensor, tf.Variable)):
        _splits_list(splits)  # a float list is an error now, not inside the graph
    inputs = [tensor] + ([] if splits is None else [tf.convert_to_tensor(splits)])

    def fn(a: np.ndarray, s: Any = None) -> tuple[np.ndarray, np.ndarray]:
        buf, _ = common.to_core_buffer(np.ascontiguousarray(a))
        out, rsplits = common.core().synchronize(common.core().alltoall_async(
            buf, splits=_splits_list(s), name=name, process_set=process_set))
        return np.ascontiguousarray(out).view(a.dtype), np.asarray(rsplits, dtype=np.int32)

    out, rsplits = run_numpy(fn, inputs, [tensor.dtype, tf.int32], "alltoall")
    if not tf.executing_eagerly():
        out.set_shape([None] + tensor.shape.as_list()[1:])
        rsplits.set_shape([None])
    return out, rsplits


def reducescatter_raw(tensors: Sequence[tf.Tensor], names: Sequence[str | None], op: ReduceOp, prescale: float,
                      postscale: float, process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Reduce each tensor across ranks and return this rank's rows of each (the first ``rows % size`` ranks get
    one row more)."""
    _check(process_set, "reducescatter()")
    for t in tensors:
        if t.shape.rank == 0:
            raise ValueError("reducescatter needs a tensor with at least one dimension, got a scalar")

    def fn(*arrays: np.ndarray) -> list[np.ndarray]:
        c = common.core()
        handles = []
        for a, n in zip(arrays, names, strict=True):
            # the core's reducescatter has no bfloat16 mode: reduce in float32, round at the end
            buf = np.array(a, dtype=np.float32 if common.is_bfloat16_dtype(a.dtype) else a.dtype, copy=True,
                           order="C")
            handles.append(c.reducescatter_async(buf, op=op, name=n, prescale=prescale, postscale=postscale,
                                                 process_set=process_set))
        return [np.ascontiguousarray(c.synchronize(h)).astype(a.dtype, copy=False)
                for h, a in zip(handles, arrays, strict=True)]

    outs = run_numpy(fn, tensors, [t.dtype for t in tensors], "reducescatter")
    if not tf.executing_eagerly():
        for o, t in zip(outs, tensors, strict=True):
            o.set_shape([None] + t.shape.as_list()[1:])
    return outs


# ------------------------------------------------------------------------------ rank and size as tensors

def _set_ranks(process_set_id: int) -> list[int]:
    from spark_hvd.core import process_sets

    member = process_sets._sets.get(process_set_id)
    if member is None:
        raise ValueError(f"no process set with id {process_set_id} is registered on rank {common.rank()}")
    return list(member.ranks)


def _int_op(value: Callable[[], int], what: str, name: str | None) -> tf.Tensor:
    require_init(what)
    if tf.executing_eagerly():
        return tf.constant(value(), dtype=tf.int32)
    out = tf.numpy_function(lambda: np.int32(value()), [], tf.int32, stateful=True, name=name or what)
    out.set_shape([])
    return out


def rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank as an int32 tensor, read when the op runs (Horovod's ``rank_op``)."""
    return _int_op(common.rank, "rank_op", name)


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The job's size (or a process set's, by id) as an int32 tensor, read when the op runs."""
    if process_set_id == 0:
        return _int_op(common.size, "size_op", name)
    return _int_op(lambda: len(_set_ranks(process_set_id)), "size_op", name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank on its host as an int32 tensor, read when the op runs."""
    return _int_op(common.local_rank, "local_rank_op", name)


def local_size_op(name: str | None = None) -> tf.Tensor:
    """The number of processes on this host as an int32 tensor, read when the op runs."""
    return _int_op(common.local_size, "local_size_op", name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 when this rank belongs to process set ``process_set_id`` (the global set: always), else 0."""
    if process_set_id == 0:
        return _int_op(lambda: 1, "process_set_included_op", name)
    return _int_op(lambda: int(common.rank() in _set_ranks(process_set_id)), "process_set_included_op", name)
