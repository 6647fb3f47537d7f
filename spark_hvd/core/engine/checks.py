"""What ``Engine.enqueue`` checks before a request exists: a host array or a device tensor that the collective can
take, on the caller's thread, so a bad call fails there and no rank waits for it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from spark_hvd.core.algorithms import adasum
from spark_hvd.core.backend import ReduceOp, alltoall_args
from spark_hvd.core.engine.device import DeviceBuffer
from spark_hvd.core.engine.negotiation import RAGGED, Meta
from spark_hvd.core.reduce import SUPPORTED_DTYPES, check_dtype

BARRIER_META = Meta("barrier", "", (), "", 0, 1.0, 1.0, False)  # what every barrier agrees on


def request(kind: str, buf: Any, name: str, op: ReduceOp, root: int, prescale: float, postscale: float,
            bfloat16: bool, splits: Sequence[int] | None, size: int) -> tuple[Any, Meta, Sequence[int] | None]:
    """What a submission of ``kind`` negotiates, among ``size`` ranks: (the buffer the collective takes, its
    metadata, the alltoall's splits), or the error that fails it on the caller, before any rank waits. ``op``: a
    ``ReduceOp`` member (its ``_value_`` is read directly: ``Enum.value`` is a property, hashing a member a Python
    call, both slow on the enqueue path)."""
    if op is ReduceOp.ADASUM:  # what Adasum cannot reduce
        device = buf.device if isinstance(buf, DeviceBuffer) else ""
        adasum.check_request(kind, getattr(buf, "dtype", None), bfloat16, device, name)
    if kind == "barrier":
        return None, BARRIER_META, splits
    if isinstance(buf, DeviceBuffer):
        splits = device_splits(kind, buf, name, root, splits, size)
        return buf, Meta(kind, buf.dtype.str, buf.shape, op._value_, int(root), float(prescale),
                         float(postscale), buf.bfloat16, buf.device), splits
    buf = host_buffer(kind, buf, name, bfloat16)
    if kind == "broadcast" and not 0 <= int(root) < size:
        raise ValueError(f"broadcast of '{name}': root_rank {root} is not a rank of this job of size {size}")
    if kind == "alltoall":
        try:
            buf, splits = alltoall_args(buf, splits, size)
        except ValueError as exc:
            raise ValueError(f"alltoall of '{name}': {exc}") from None
    return buf, Meta(kind, buf.dtype.str, buf.shape, op._value_, int(root), float(prescale), float(postscale),
                     bool(bfloat16)), splits


def host_buffer(kind: str, buf: Any, name: str, bfloat16: bool) -> np.ndarray:
    """``buf`` as the collective ``kind`` takes it (in place: as it is; else C-contiguous, at least one row for
    the ragged kinds), or a ``TypeError`` / ``ValueError`` naming the collective and the tensor."""
    if not isinstance(buf, np.ndarray):
        raise TypeError(f"{kind} of '{name}': expected a numpy array, got {type(buf).__name__}")
    if bfloat16 and buf.dtype != np.uint16:
        raise TypeError(f"{kind} of '{name}': bfloat16 data must be passed as a uint16 view, got {buf.dtype}")
    if kind in ("allreduce", "reducescatter"):
        try:
            check_dtype(buf, bfloat16)
        except TypeError as exc:
            raise TypeError(f"{kind} of '{name}': {exc}") from None
    if kind in ("allreduce", "broadcast"):
        flags = buf.flags
        if not (flags.c_contiguous and flags.writeable):  # ``in_place_ok``, inline on the enqueue path
            raise ValueError(f"{kind} of '{name}' works in place and needs a C-contiguous writable array")
    else:
        buf = np.ascontiguousarray(buf)
        if kind in RAGGED and buf.ndim == 0:
            buf = buf.reshape(1)
    return buf


def device_splits(kind: str, buf: DeviceBuffer, name: str, root: int, splits: Sequence[int] | None,
                  size: int) -> list[int] | None:
    """Check a device tensor for ``kind`` among ``size`` ranks; the alltoall's splits (None for the other kinds)."""
    if kind in ("allreduce", "reducescatter") and buf.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{kind} of '{name}': cannot reduce tensors of dtype {buf.dtype}")
    if kind == "broadcast" and not 0 <= int(root) < size:
        raise ValueError(f"broadcast of '{name}': root_rank {root} is not a rank of this job of size {size}")
    if kind in RAGGED and not buf.shape:
        raise ValueError(f"{kind} of '{name}' needs a tensor with at least one dimension")
    if kind == "alltoall":
        try:  # the splits rules of host arrays, checked on an empty stand-in of the same rows
            return alltoall_args(np.empty((buf.shape[0], 0)), splits, size)[1]
        except ValueError as exc:
            raise ValueError(f"alltoall of '{name}': {exc}") from None
    return None


def in_place_ok(flags: Any) -> bool:
    """An array an allreduce may work on in place (``np.ndarray.flags``): C-contiguous and writable."""
    return bool(flags.c_contiguous and flags.writeable)
