"""MXNet NDArrays to and from the core's numpy buffers, with at most one copy each way (none where MXNet allows).

The core reduces numpy arrays in place. MXNet's own conversions copy: ``NDArray.asnumpy()`` copies the array's
memory out, ``mx.nd.array(a)`` copies it in (and costs about 0.3 ms even for 4 KiB). DLPack does not help on the
way out under numpy < 1.25: ``np.from_dlpack`` of ``mx.nd.to_dlpack_for_write`` gives a read-only array. Here:

- ``read_view(nd)`` / ``write_view(nd)``: a numpy array over the NDArray's own memory (the pointer of
  ``MXNDArrayGetData``, shape and dtype, through ``__array_interface__``; the array keeps the NDArray alive; kept
  for small arrays used again, ``_VIEWS``). MXNet runs its operators asynchronously, so a view waits first: for
  reading, for the array's pending writes (``MXNDArrayWaitToRead``); for writing, for every pending operator
  (``MXNDArrayWaitAll``: about 0.3 us when nothing is pending, where waiting for one array's reads and writes,
  ``MXNDArrayWaitToWrite``, pushes an operator through MXNet's engine and costs about 24 us). A read view is
  read-only.
- ``to_ndarray(a, like)``: a numpy buffer the caller owns (nobody writes it again) becomes an NDArray over the same
  memory by DLPack (``mx.nd.from_dlpack``, about 5 us) when ``like`` lives on ``cpu(0)``; on another context it is
  copied there.

NDArrays on a GPU, and sparse ones, are staged through a host copy (``Staged``): this binding has no device path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import mxnet as mx
import numpy as np
from mxnet.base import _LIB, check_call

from spark_hvd import _binding_common as common

__all__ = ["DTYPES", "Staged", "check_dtype", "cpu_context", "host_input", "read_view", "stage_all", "to_ndarray",
           "wait_all", "wait_to_read", "wait_to_write", "write_view"]

#: the dtypes the collectives take (Horovod's MXNet set)
DTYPES = frozenset(np.dtype(t) for t in (np.uint8, np.int8, np.int32, np.int64, np.float16, np.float32,
                                         np.float64))

_CPU0 = mx.cpu(0)
_CONTEXT = type(_CPU0)  # mx.Context (MXNet 1.x; a function returning mx.device.Device in MXNet 2)
_NP_NDARRAY = mx.np.ndarray  # MXNet's numpy-compatible arrays (an NDArray subclass)
_HOST_DEVICES = frozenset({1, 3, 5})  # MXNet's device types cpu, cpu_pinned, cpu_shared (2 is gpu)
_DEFAULT_STORAGE = 0  # dense (1: row_sparse, 2: csr)
_GET_DATA = _LIB.MXNDArrayGetData
_GET_CONTEXT = _LIB.MXNDArrayGetContext
_GET_STORAGE = _LIB.MXNDArrayGetStorageType
_WAIT_TO_READ = _LIB.MXNDArrayWaitToRead
_WAIT_TO_WRITE = _LIB.MXNDArrayWaitToWrite
_WAIT_ALL = _LIB.MXNDArrayWaitAll

# Writable views of small dense host NDArrays, by ``id(nd)``: (view, handle, data pointer). Building a view costs a
# few ctypes calls (context, storage, shape, dtype) and the numpy array itself, about as much as the round of a
# small allreduce between two local ranks; a gradient or a parameter comes back every step. A kept view holds its
# NDArray (the view's base refers to it), so no other object can take that id while it is kept; the handle and data
# pointer are checked anyway. An array is kept from its second call on (``_SEEN`` remembers the first by id, handle
# and pointer, without holding it: NDArrays take no weak references), at most ``_VIEWS_MAX`` arrays of up to
# ``_VIEW_MAX_BYTES`` each (emptied when full).
_VIEWS: dict[int, tuple[np.ndarray, int, int]] = {}
_SEEN: dict[int, tuple[int, int]] = {}
_VIEWS_MAX = 512
_VIEW_MAX_BYTES = 1 << 16


class _Interface:
    """The ``__array_interface__`` of an NDArray's memory; ``owner`` keeps the NDArray alive while a view lives."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, interface: dict[str, Any], owner: Any) -> None:
        self.__array_interface__ = interface
        self.owner = owner


def cpu_context() -> Any:
    """``mx.cpu(0)``, where Horovod puts the received splits of ``alltoall``."""
    return _CPU0


def check_dtype(nd: Any, what: str) -> np.dtype:
    """The numpy dtype of ``nd``; ``ValueError`` naming ``what``, the dtype and the rank unless the collectives
    take it."""
    dtype = np.dtype(nd.dtype)
    if dtype not in DTYPES:
        raise ValueError(f"{what} on rank {common.rank()}: NDArrays of dtype {dtype.name} are not supported; use "
                         f"one of {sorted(d.name for d in DTYPES)}")
    return dtype


def wait_all() -> None:
    """Wait for every operator MXNet has queued (reads and writes of every array); cheap when none is pending."""
    check_call(_WAIT_ALL())


def wait_to_read(nd: Any) -> None:
    """Wait for MXNet's queued writes to ``nd`` (not for its queued reads)."""
    check_call(_WAIT_TO_READ(nd.handle))


def wait_to_write(nd: Any) -> None:
    """Wait for MXNet's queued reads and writes of ``nd`` (MXNet pushes an operator through its engine for it: about
    24 us even when nothing is queued, where :func:`wait_all` costs 0.3 us then)."""
    check_call(_WAIT_TO_WRITE(nd.handle))


def _device(nd: Any) -> tuple[int, int]:
    dev_type, dev_id = ctypes.c_int(), ctypes.c_int()
    check_call(_GET_CONTEXT(nd.handle, ctypes.byref(dev_type), ctypes.byref(dev_id)))
    return dev_type.value, dev_id.value


def _dense_host(nd: Any) -> bool:
    stype = ctypes.c_int()
    check_call(_GET_STORAGE(nd.handle, ctypes.byref(stype)))
    return stype.value == _DEFAULT_STORAGE and _device(nd)[0] in _HOST_DEVICES


def _host_view(nd: Any) -> np.ndarray | None:
    """A writable numpy array over dense host NDArray ``nd``'s memory (kept for small arrays used again), None
    for a GPU or sparse NDArray. The caller waits for MXNet's queued operators first."""
    handle = nd.handle
    ptr = ctypes.c_void_p()
    check_call(_GET_DATA(handle, ctypes.byref(ptr)))
    key, address, where = id(nd), handle.value, ptr.value
    entry = _VIEWS.get(key)
    if entry is not None and entry[1] == address and entry[2] == where:
        return entry[0]
    if not _dense_host(nd):
        return None
    shape, dtype = nd.shape, np.dtype(nd.dtype)
    if where is None:  # an empty array has no memory
        return np.empty(shape, dtype)
    view = np.asarray(_Interface({"data": (where, False), "shape": shape, "typestr": dtype.str, "version": 3}, nd))
    if view.nbytes <= _VIEW_MAX_BYTES:
        if entry is not None:
            _VIEWS.pop(key, None)
        if _SEEN.get(key) == (address, where):  # its second call: an array used again, worth keeping a view of
            _SEEN.pop(key, None)
            if len(_VIEWS) >= _VIEWS_MAX:
                _VIEWS.clear()
            _VIEWS[key] = (view, address, where)
        else:
            if len(_SEEN) >= _VIEWS_MAX:
                _SEEN.clear()
            _SEEN[key] = (address, where)
    return view


def _readonly(view: np.ndarray) -> np.ndarray:
    out = view.view()
    out.flags.writeable = False
    return out


def read_view(nd: Any) -> np.ndarray:
    """A read-only numpy view of dense host NDArray ``nd``'s memory, after its pending writes."""
    check_call(_WAIT_TO_READ(nd.handle))
    view = _host_view(nd)
    if view is None:
        raise ValueError(f"read_view needs a dense NDArray in host memory, got one on {nd.context} ({nd.stype})")
    return _readonly(view)


def write_view(nd: Any, waited: bool = False) -> np.ndarray:
    """A writable numpy view of dense host NDArray ``nd``'s memory, after every pending operator (``waited``: the
    caller has just called :func:`wait_all`)."""
    if not waited:
        wait_all()
    view = _host_view(nd)
    if view is None:
        raise ValueError(f"write_view needs a dense NDArray in host memory, got one on {nd.context} ({nd.stype})")
    return view


def to_ndarray(a: np.ndarray, like: Any) -> Any:
    """Owned numpy buffer ``a`` as an NDArray on ``like``'s context (``like``: an NDArray or a context), over the
    same memory where MXNet can take it (a C-contiguous DLPack dtype on ``cpu(0)``), else copied there; an
    ``mx.np.ndarray`` when ``like`` is one (a shallow copy: the same memory)."""
    out = _to_nd(a, like)
    return out.as_np_ndarray() if isinstance(like, _NP_NDARRAY) else out


def _to_nd(a: np.ndarray, like: Any) -> Any:
    if isinstance(like, _CONTEXT):
        on_cpu0 = like == _CPU0
    else:
        on_cpu0 = _device(like) == (1, 0)
    if on_cpu0 and a.flags.c_contiguous and a.dtype in DTYPES and a.size:
        return mx.nd.from_dlpack(a.__dlpack__())
    ctx = like if isinstance(like, _CONTEXT) else like.context
    out = mx.nd.empty(a.shape, ctx=ctx, dtype=a.dtype)
    if a.size:
        if ctx.device_type == "cpu":
            np.copyto(write_view(out), a)
        else:
            out[:] = a
    return out


class Staged:
    """A numpy buffer the core may write for NDArray ``nd``: its own memory for a dense host array, else a host
    copy that :meth:`finish` writes back (a GPU or sparse NDArray)."""

    __slots__ = ("buf", "nd", "_copied")

    def __init__(self, nd: Any, waited: bool = False) -> None:
        if not waited:
            wait_all()
        self.nd = nd
        view = _host_view(nd)
        self._copied = view is None
        self.buf = nd.asnumpy() if view is None else view  # asnumpy: a new C-contiguous array, the one copy

    def finish(self) -> Any:
        """Write a staged copy back into the NDArray; returns the NDArray."""
        if self._copied:
            self.nd[:] = self.buf
        return self.nd


def host_input(nd: Any) -> np.ndarray:
    """A numpy array with ``nd``'s values that the caller only reads: a view of a dense host array, else a copy."""
    check_call(_WAIT_TO_READ(nd.handle))
    view = _host_view(nd)
    return nd.asnumpy() if view is None else _readonly(view)


def stage_all(nds: Sequence[Any]) -> list[Staged]:
    """:class:`Staged` buffers of several NDArrays after one wait for MXNet's queued operators."""
    wait_all()
    return [Staged(nd, waited=True) for nd in nds]
