"""MXNet NDArrays to and from the core's numpy buffers, with at most one copy each way (none where MXNet allows).

The core reduces numpy arrays in place. MXNet's own conversions copy: ``NDArray.asnumpy()`` copies the array's
memory out, ``mx.nd.array(a)`` copies it in (and costs about 0.3 ms even for 4 KiB). DLPack does not help on the
way out under numpy < 1.25: ``np.from_dlpack`` of ``mx.nd.to_dlpack_for_write`` gives a read-only array. Here:

- ``read_view(nd)`` / ``write_view(nd)``: a numpy array over the NDArray's own memory (the pointer of
  ``MXNDArrayGetData``, shape and dtype, through ``__array_interface__``; the array keeps the NDArray alive). MXNet
  runs its operators asynchronously, so a view waits first: for reading, for the array's pending writes
  (``MXNDArrayWaitToRead``); for writing, for every pending operator (``mx.nd.waitall()``: about 0.3 us when
  nothing is pending, where waiting for one array's reads and writes, ``MXNDArrayWaitToWrite``, pushes an
  operator through MXNet's engine and costs about 24 us). A read view is read-only.
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
           "wait_all", "write_view"]

#: the dtypes the collectives take (Horovod's MXNet set)
DTYPES = frozenset(np.dtype(t) for t in (np.uint8, np.int8, np.int32, np.int64, np.float16, np.float32,
                                         np.float64))

_CPU0 = mx.cpu(0)


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
    mx.nd.waitall()


def _view(nd: Any, readonly: bool) -> np.ndarray:
    ptr = ctypes.c_void_p()
    check_call(_LIB.MXNDArrayGetData(nd.handle, ctypes.byref(ptr)))
    shape = nd.shape
    dtype = np.dtype(nd.dtype)
    if ptr.value is None:  # an empty array has no memory
        return np.empty(shape, dtype)
    return np.asarray(_Interface({"data": (ptr.value, readonly), "shape": shape, "typestr": dtype.str,
                                  "version": 3}, nd))


def _is_host(nd: Any) -> bool:
    return nd.stype == "default" and nd.context.device_type in ("cpu", "cpu_pinned", "cpu_shared")


def read_view(nd: Any) -> np.ndarray:
    """A read-only numpy view of host NDArray ``nd``'s memory, after its pending writes."""
    check_call(_LIB.MXNDArrayWaitToRead(nd.handle))
    return _view(nd, readonly=True)


def write_view(nd: Any, waited: bool = False) -> np.ndarray:
    """A writable numpy view of host NDArray ``nd``'s memory, after every pending operator (``waited``: the caller
    has just called :func:`wait_all`)."""
    if not waited:
        wait_all()
    return _view(nd, readonly=False)


def to_ndarray(a: np.ndarray, like: Any) -> Any:
    """Owned numpy buffer ``a`` as an NDArray on ``like``'s context (``like``: an NDArray or a context), over the
    same memory where MXNet can take it (a C-contiguous DLPack dtype on ``cpu(0)``), else copied there."""
    ctx = like if isinstance(like, mx.Context) else like.context
    if ctx == _CPU0 and a.flags.c_contiguous and a.dtype in DTYPES and a.size:
        return mx.nd.from_dlpack(a.__dlpack__())
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
        self.nd = nd
        self._copied = not _is_host(nd)
        if self._copied:
            self.buf = np.array(nd.asnumpy(), order="C", copy=False)
            if not self.buf.flags.writeable:
                self.buf = self.buf.copy()
        else:
            self.buf = write_view(nd, waited)

    def finish(self) -> Any:
        """Write a staged copy back into the NDArray; returns the NDArray."""
        if self._copied:
            self.nd[:] = self.buf
        return self.nd


def host_input(nd: Any) -> np.ndarray:
    """A numpy array with ``nd``'s values that the caller only reads: a view of a dense host array, else a copy."""
    return read_view(nd) if _is_host(nd) else nd.asnumpy()


def stage_all(nds: Sequence[Any]) -> list[Staged]:
    """:class:`Staged` buffers of several NDArrays after one wait for MXNet's queued operators."""
    wait_all()
    return [Staged(nd, waited=True) for nd in nds]
