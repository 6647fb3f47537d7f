"""Horovod's MXNet collectives on NDArrays, over the core's engine.

Every collective returns when it is done (Horovod's MXNet ops were queued on MXNet's engine; here the result is
there when the call returns, so ``wait_to_read()`` on it is free). ``priority`` is accepted for Horovod
compatibility and ignored: the engine orders collectives by negotiation, not by priority.

Copies (``spark_hvd.mxnet.ndarray``): the in-place forms (``allreduce_``, ``grouped_allreduce_``, ``broadcast_``)
reduce in the NDArray's own memory, no copy; the out-of-place forms copy the input once into a new aligned buffer
(the result's memory), which becomes the returned NDArray without another copy; allgather, alltoall and
reducescatter read the input where it lies and hand the core's result to MXNet without a copy.

Names: a collective without a name takes the engine's per-kind counter (the same on every rank that calls in the
same order); a grouped collective named ``n`` names its members ``n.0``, ``n.1``, ...

Errors: a tensor whose shape, dtype or root differs between ranks raises the core's ``TensorMismatchError``, a dead
or silent peer ``PeerFailureError`` naming the rank; both are ``RuntimeError`` (as ``MXNetError`` is), which is
what Horovod's MXNet tests catch. Bad arguments raise :class:`CollectiveArgumentError`, both a ``ValueError`` and
an ``MXNetError``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import mxnet as mx
import numpy as np
from mxnet.base import MXNetError

from spark_hvd import _binding_common as common
from spark_hvd._binding_common import Average, set_rank, set_size  # noqa: F401 - set_rank, set_size re-exported
from spark_hvd._process_api import *  # noqa: F403 - Horovod's process API, re-exported as its mpi_ops does
from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.errors import SparkHvdError
from spark_hvd.core.process_sets import ProcessSet, global_process_set
from spark_hvd.mxnet import ndarray as nda

_F = TypeVar("_F", bound=Callable[..., Any])


class CollectiveArgumentError(ValueError, MXNetError):
    """Bad arguments of a collective (a dtype, a scalar, alltoall splits, a root rank), found here or by the
    engine: a ``ValueError``, and MXNet's own ``MXNetError`` as Horovod's MXNet ops raised."""


def _mxnet_errors(fn: _F) -> _F:
    """``fn`` with its ``ValueError`` s raised as :class:`CollectiveArgumentError` (``NotInitializedError`` and
    the core's other errors pass as they are)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (CollectiveArgumentError, SparkHvdError):
            raise
        except ValueError as e:
            raise CollectiveArgumentError(str(e)) from e
    return wrapper  # type: ignore[return-value]


def init(*args: Any, **kwargs: Any) -> None:
    """Join the job (idempotent). Arguments go to :func:`spark_hvd.core.init`; none are needed under
    ``spark-hvd-run`` or the Spark runner. MXNet has no current device to pin: put a rank's arrays on
    ``mx.gpu(hvd.local_rank())`` yourself where there are GPUs."""
    common.core().init(*args, **kwargs)


def nccl_built() -> int:
    """0: this binding has no NCCL path (GPU NDArrays are staged through host memory)."""
    return 0


def cuda_built() -> bool:
    """False: this binding has no CUDA kernels of its own."""
    return False


def rocm_built() -> bool:
    """False: this binding has no ROCm kernels of its own."""
    return False


# ------------------------------------------------------------------------------------------------- helpers

def _check(process_set: ProcessSet | None, what: str) -> None:
    common.require_init(what)
    common.check_member(process_set, what)


def _name(name: Any) -> str | None:
    """Horovod's rule: a ``str`` name is the collective's name, anything else means none."""
    return name if isinstance(name, str) else None


def _names(name: str | None, count: int) -> list[str | None]:
    return [None] * count if name is None else [f"{name}.{i}" for i in range(count)]


def _ndarrays(tensors: Any, what: str) -> list[Any]:
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, mx.nd.NDArray):
            raise ValueError(f"{what} on rank {common.rank()}: tensor {i} is a {type(t).__name__}, not an "
                             "mx.nd.NDArray")
        nda.check_dtype(t, what)
    return tensors


def _check_context(tensors: Sequence[Any], what: str) -> None:
    kinds = {t.context.device_type for t in tensors}
    if len(kinds) > 1:
        raise ValueError(f"{what} on rank {common.rank()}: the tensors of one grouped collective must all be on "
                         f"the CPU or all on a GPU, got {sorted(kinds)}")


def _reduce_op(op: Any, average: bool | None, what: str, allowed: Sequence[ReduceOp] | None = None) -> ReduceOp:
    rop = common.resolve_op(op, average)
    if allowed is not None and rop not in allowed:
        raise ValueError(f"{what}: op must be one of {[a.value for a in allowed]}, got {rop.value}")
    return rop


# ------------------------------------------------------------------------------------------------ allreduce

def allreduce_inplace(tensors: list[Any], names: list[str | None], op: ReduceOp, prescale: float,
                      postscale: float, process_set: ProcessSet) -> None:
    """Reduce ``tensors`` (NDArrays) in place, after MXNet's queued operators: one blocking allreduce for one
    tensor (the engine runs it in this thread), one grouped collective for several."""
    staged = nda.stage_all(tensors)
    c = common.core()
    if len(staged) == 1:  # the blocking call: the round runs in this thread (the engine's fast path)
        c.allreduce(staged[0].buf, name=names[0], op=op, prescale=prescale, postscale=postscale,
                    process_set=process_set)
    else:
        c.grouped_allreduce([s.buf for s in staged], names=names, op=op, prescale=prescale, postscale=postscale,
                            process_set=process_set)
    for s in staged:
        s.finish()


def _allreduce_copy(tensors: list[Any], names: list[str | None], op: ReduceOp, prescale: float, postscale: float,
                    process_set: ProcessSet) -> list[Any]:
    inputs = [nda.host_input(t) for t in tensors]
    c = common.core()
    if len(inputs) > 1 and len({a.dtype for a in inputs}) == 1 and op is not ReduceOp.ADASUM:
        # one dtype: packed into one aligned buffer (the one copy) and reduced by one blocking call; the results
        # are views of it (not for Adasum: its coefficients are per tensor)
        flat, outs = common.packed(inputs)
        c.allreduce(flat, name=None if names[0] is None else f"{names[0]}.packed", op=op, prescale=prescale,
                    postscale=postscale, process_set=process_set)
    else:
        outs = []
        for a in inputs:
            buf = common.aligned_empty(a.shape, a.dtype)
            np.copyto(buf, a)
            outs.append(buf)
        if len(outs) == 1:
            c.allreduce(outs[0], name=names[0], op=op, prescale=prescale, postscale=postscale,
                        process_set=process_set)
        else:
            c.grouped_allreduce(outs, names=names, op=op, prescale=prescale, postscale=postscale,
                                process_set=process_set)
    return [nda.to_ndarray(o, t) for o, t in zip(outs, tensors, strict=True)]


@_mxnet_errors
def allreduce(tensor: Any, average: bool | None = None, name: str | None = None, priority: int = 0,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set, op: ReduceOp | None = None) -> Any:
    """``tensor`` reduced across the ranks of ``process_set`` (``op``: ``Average`` by default, ``Sum``, ``Min``,
    ``Max``, ``Product``, ``Adasum``) as a new NDArray of the same shape, dtype and context; ``tensor`` is not
    modified. ``prescale_factor`` multiplies the input, ``postscale_factor`` the result; ``average`` is Horovod's
    deprecated form of ``op``."""
    _check(process_set, "allreduce()")
    rop = _reduce_op(op, average, "allreduce()")
    (t,) = _ndarrays([tensor], "allreduce()")
    return _allreduce_copy([t], [_name(name)], rop, prescale_factor, postscale_factor, process_set)[0]


@_mxnet_errors
def allreduce_(tensor: Any, average: bool | None = None, name: str | None = None, priority: int = 0,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set, op: ReduceOp | None = None) -> Any:
    """:func:`allreduce` in place: the result is written into ``tensor``, which is returned."""
    _check(process_set, "allreduce_()")
    rop = _reduce_op(op, average, "allreduce_()")
    (t,) = _ndarrays([tensor], "allreduce_()")
    allreduce_inplace([t], [_name(name)], rop, prescale_factor, postscale_factor, process_set)
    return t


@_mxnet_errors
def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None, name: str | None = None,
                      priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set, op: ReduceOp | None = None) -> list[Any]:
    """:func:`allreduce` of several NDArrays as one collective (fused by the engine); new NDArrays in order."""
    _check(process_set, "grouped_allreduce()")
    rop = _reduce_op(op, average, "grouped_allreduce()")
    ts = _ndarrays(tensors, "grouped_allreduce()")
    if not ts:
        return []
    _check_context(ts, "grouped_allreduce()")
    return _allreduce_copy(ts, _names(_name(name), len(ts)), rop, prescale_factor, postscale_factor, process_set)


@_mxnet_errors
def grouped_allreduce_(tensors: Sequence[Any], average: bool | None = None, name: str | None = None,
                       priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set, op: ReduceOp | None = None) -> list[Any]:
    """:func:`grouped_allreduce` in place; returns ``tensors``."""
    _check(process_set, "grouped_allreduce_()")
    rop = _reduce_op(op, average, "grouped_allreduce_()")
    ts = _ndarrays(tensors, "grouped_allreduce_()")
    if ts:
        _check_context(ts, "grouped_allreduce_()")
        allreduce_inplace(ts, _names(_name(name), len(ts)), rop, prescale_factor, postscale_factor, process_set)
    return ts


@_mxnet_errors
def allreduce_async_inplace(tensors: Sequence[Any], names: Sequence[str | None], op: ReduceOp, prescale: float,
                            postscale: float, process_set: ProcessSet, as_ready: bool = False) -> Any:
    """Queue in-place allreduces of ``tensors`` (host NDArrays) without waiting; returns a function that waits
    for them (and writes staged copies back). For the trainer and the optimizer, which submit every gradient
    before waiting for any.

    By default every queued MXNet operator is waited for first and the tensors go as one group. ``as_ready``:
    each tensor, in the order given, is submitted as soon as MXNet's queued reads and writes of it are done, so the
    first ones are reduced while MXNet still computes the others (give them in the order backward produces them).
    """
    tensors = _ndarrays(tensors, "allreduce_()")
    c = common.core()
    if not as_ready:
        staged = nda.stage_all(tensors)
        handles = [c.grouped_allreduce_async([s.buf for s in staged], names=list(names), op=op, prescale=prescale,
                                             postscale=postscale, process_set=process_set)]
    else:
        staged, handles = [], []
        for t, n in zip(tensors, names, strict=True):
            nda.wait_to_write(t)
            staged.append(nda.Staged(t, waited=True))
            handles.append(c.allreduce_async(staged[-1].buf, name=n, op=op, prescale=prescale, postscale=postscale,
                                             process_set=process_set))

    def wait() -> None:
        for h in handles:
            h.wait()
        for s in staged:
            s.finish()
    return wait


# ------------------------------------------------------------------------------------------------ allgather

def _gather(tensors: list[Any], names: list[str | None], process_set: ProcessSet, what: str) -> list[Any]:
    for t in tensors:
        if t.ndim == 0:
            raise ValueError(f"{what} on rank {common.rank()} needs an NDArray with at least one dimension, got a "
                             "scalar (reshape it to (1,))")
    c = common.core()
    handles = [c.allgather_async(np.ascontiguousarray(nda.host_input(t)), name=n, process_set=process_set)
               for t, n in zip(tensors, names, strict=True)]
    return [nda.to_ndarray(np.ascontiguousarray(c.synchronize(h)), t) for h, t in zip(handles, tensors, strict=True)]


@_mxnet_errors
def allgather(tensor: Any, name: str | None = None, priority: int = 0,
              process_set: ProcessSet = global_process_set) -> Any:
    """Every rank's (of ``process_set``) ``tensor`` concatenated on dimension 0, which may differ by rank."""
    _check(process_set, "allgather()")
    return _gather(_ndarrays([tensor], "allgather()"), [_name(name)], process_set, "allgather()")[0]


@_mxnet_errors
def grouped_allgather(tensors: Sequence[Any], name: str | None = None, priority: int = 0,
                      process_set: ProcessSet = global_process_set) -> list[Any]:
    """:func:`allgather` of each of ``tensors``, submitted together."""
    _check(process_set, "grouped_allgather()")
    ts = _ndarrays(tensors, "grouped_allgather()")
    if not ts:
        return []
    _check_context(ts, "grouped_allgather()")
    return _gather(ts, _names(_name(name), len(ts)), process_set, "grouped_allgather()")


# ------------------------------------------------------------------------------------------------ broadcast

@_mxnet_errors
def broadcast(tensor: Any, root_rank: int, name: str | None = None, priority: int = 0,
              process_set: ProcessSet = global_process_set) -> Any:
    """Root's ``tensor`` (``root_rank`` a global rank) as a new NDArray on every rank of ``process_set``;
    ``tensor`` is not modified."""
    _check(process_set, "broadcast()")
    (t,) = _ndarrays([tensor], "broadcast()")
    src = nda.host_input(t)
    buf = common.aligned_empty(src.shape, src.dtype)
    if common.rank() == root_rank:
        np.copyto(buf, src)
    common.core().broadcast(buf, root_rank, name=_name(name), process_set=process_set)
    return nda.to_ndarray(buf, t)


@_mxnet_errors
def broadcast_(tensor: Any, root_rank: int, name: str | None = None, priority: int = 0,
               process_set: ProcessSet = global_process_set) -> Any:
    """:func:`broadcast` in place: root's values are written into ``tensor``, which is returned."""
    _check(process_set, "broadcast_()")
    (t,) = _ndarrays([tensor], "broadcast_()")
    (staged,) = nda.stage_all([t])
    common.core().broadcast(staged.buf, root_rank, name=_name(name), process_set=process_set)
    return staged.finish()


@_mxnet_errors
def broadcast_inplace_async(tensors: Sequence[Any], names: Sequence[str | None], root_rank: int,
                            process_set: ProcessSet) -> Any:
    """Queue in-place broadcasts of several NDArrays; returns a function that waits for them (for
    ``broadcast_parameters``)."""
    staged = nda.stage_all(_ndarrays(tensors, "broadcast_()"))
    c = common.core()
    handles = [c.broadcast_async(s.buf, root_rank, name=n, process_set=process_set)
               for s, n in zip(staged, names, strict=True)]

    def wait() -> None:
        for h, s in zip(handles, staged, strict=True):
            c.synchronize(h)
            s.finish()
    return wait


# ------------------------------------------------------------------------------------------------- alltoall

def _splits_list(splits: Any) -> list[int] | None:
    if splits is None:
        return None
    arr = splits.asnumpy() if isinstance(splits, mx.nd.NDArray) else np.asarray(splits)
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"alltoall on rank {common.rank()}: splits must be integers (int32 in Horovod), got "
                         f"{arr.dtype.name}")
    return [int(x) for x in arr.reshape(-1)]


@_mxnet_errors
def alltoall(tensor: Any, splits: Any = None, name: str | None = None, priority: int = 0,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[i]`` rows of ``tensor`` to rank i of ``process_set`` (an even split when None); returns the
    rows received, in rank order, and with ``splits`` given ``(rows, received splits)`` (int32), as Horovod."""
    _check(process_set, "alltoall()")
    (t,) = _ndarrays([tensor], "alltoall()")
    split_list = _splits_list(splits)
    out, rsplits = common.core().alltoall(np.ascontiguousarray(nda.host_input(t)), splits=split_list,
                                          name=_name(name), process_set=process_set)
    result = nda.to_ndarray(np.ascontiguousarray(out), t)
    if splits is None:
        return result
    return result, nda.to_ndarray(np.asarray(rsplits, dtype=np.int32), nda.cpu_context())


# -------------------------------------------------------------------------------------------- reducescatter

def _scatter(tensors: list[Any], names: list[str | None], op: ReduceOp, prescale: float, postscale: float,
             process_set: ProcessSet, what: str) -> list[Any]:
    for t in tensors:
        if t.ndim == 0:
            raise ValueError(f"{what} on rank {common.rank()} does not support scalar inputs")
    c = common.core()
    handles = [c.reducescatter_async(np.ascontiguousarray(nda.host_input(t)), op=op, name=n, prescale=prescale,
                                     postscale=postscale, process_set=process_set)
               for t, n in zip(tensors, names, strict=True)]
    return [nda.to_ndarray(np.ascontiguousarray(c.synchronize(h)), t) for h, t in zip(handles, tensors, strict=True)]


@_mxnet_errors
def reducescatter(tensor: Any, op: ReduceOp = Average, name: str | None = None, priority: int = 0,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> Any:
    """Reduce ``tensor`` across ranks (``Average`` or ``Sum``) and return this rank's rows of the result (the
    first ``rows % size`` ranks get one row more); ``tensor`` is not modified."""
    _check(process_set, "reducescatter()")
    rop = _reduce_op(op, None, "reducescatter()", (ReduceOp.AVERAGE, ReduceOp.SUM))
    ts = _ndarrays([tensor], "reducescatter()")
    return _scatter(ts, [_name(name)], rop, prescale_factor, postscale_factor, process_set, "reducescatter()")[0]


@_mxnet_errors
def grouped_reducescatter(tensors: Sequence[Any], op: ReduceOp = Average, name: str | None = None,
                          priority: int = 0, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[Any]:
    """:func:`reducescatter` of each of ``tensors``, submitted together."""
    _check(process_set, "grouped_reducescatter()")
    rop = _reduce_op(op, None, "grouped_reducescatter()", (ReduceOp.AVERAGE, ReduceOp.SUM))
    ts = _ndarrays(tensors, "grouped_reducescatter()")
    if not ts:
        return []
    return _scatter(ts, _names(_name(name), len(ts)), rop, prescale_factor, postscale_factor, process_set,
                    "grouped_reducescatter()")
