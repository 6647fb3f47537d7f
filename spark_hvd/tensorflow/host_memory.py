"""Eager TensorFlow tensors to and from host numpy arrays with as few copies as TensorFlow allows.

The collectives need a writable C-contiguous host buffer (the engine reduces in place) and give back a new tensor.
TensorFlow's own conversions copy both ways: ``EagerTensor.numpy()`` copies the tensor's memory (TensorFlow treats
the numpy view as a way to mutate an immutable tensor), and ``tf.convert_to_tensor`` copies the array into a new
tensor. At 16 MiB those two copies cost more than the allreduce between two local ranks. Here:

- ``view(t)``: the numpy view of an eager CPU tensor's memory (``EagerTensor._numpy()``, no copy); the callers
  only read it (the engine's buffer is a copy made once, as the torch binding clones its input).
- ``writable_copy(a)``: that copy, into memory aligned as TensorFlow needs it (64 bytes, Eigen's alignment).
- ``to_tensor(a, dtype, owned)``: a buffer the caller owns and nobody writes again (``owned``) becomes a tensor over
  the same memory by DLPack, when it is aligned and its dtype has a DLPack code; anything else is copied by
  ``tf.convert_to_tensor``. TensorFlow checks alignment only when a kernel reads the tensor (and then aborts the
  process), so an unaligned array is never handed over.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from spark_hvd._binding_common import ALIGN, aligned_empty  # shared with the MXNet binding

__all__ = ["ALIGN", "aligned_empty", "to_tensor", "view", "writable_copy"]

#: dtypes whose arrays go to TensorFlow by DLPack (numpy's ``__dlpack__`` and TensorFlow's ``from_dlpack`` agree)
_DLPACK_DTYPES = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64, np.int8, np.int16, np.int32,
                                                 np.int64, np.uint8, np.uint16, np.uint32, np.uint64))

try:
    _from_dlpack = tf.experimental.dlpack.from_dlpack
except AttributeError:  # pragma: no cover - every TensorFlow 2 has it
    _from_dlpack = None


def view(t: Any) -> np.ndarray:
    """The host memory of eager tensor ``t`` as a numpy array, without a copy where TensorFlow allows (a CPU
    tensor); the caller must not write to it."""
    raw = getattr(t, "_numpy", None)
    if raw is not None:
        try:
            out = raw()
        except Exception:  # noqa: BLE001 - a private API that changed: the public copy below
            out = None
        if isinstance(out, np.ndarray):
            return out
    return t.numpy()


def writable_copy(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` that the caller owns: aligned, C-contiguous, writable."""
    out = aligned_empty(a.shape, a.dtype)
    np.copyto(out, a)
    return out


def _aligned(a: np.ndarray) -> bool:
    return a.ctypes.data % ALIGN == 0


def to_tensor(a: np.ndarray, dtype: tf.DType, owned: bool = False) -> tf.Tensor:
    """``a`` as a tensor of ``dtype``: over ``a``'s memory when ``owned`` (the caller hands it over: nobody writes
    to it again) and TensorFlow can take it (aligned, C-contiguous, a DLPack dtype, the same dtype); else a copy."""
    if (owned and _from_dlpack is not None and isinstance(a, np.ndarray) and a.size and a.flags.c_contiguous
            and a.dtype in _DLPACK_DTYPES and a.dtype == dtype.as_numpy_dtype and _aligned(a)):
        return _from_dlpack(a.__dlpack__())
    return tf.convert_to_tensor(a, dtype=dtype)
