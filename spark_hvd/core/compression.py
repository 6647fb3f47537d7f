"""Gradient compression for allreduce: none, or float16 on the wire (Horovod's ``hvd.Compression``).

One implementation serves every tensor type. ``FP16Compressor`` here works on numpy arrays; a framework binding
gets its subclass from ``framework_compression`` with its own ``half`` dtype, ``is_floating`` test and ``cast``
(``spark_hvd.torch.compression``, ``spark_hvd.tensorflow.compression``, ``spark_hvd.mxnet.compression``), so the rule
of what is compressed and how it is restored lives in one place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)`` before the allreduce, ``decompress(tensor, ctx)`` after.

    ``ctx`` carries what ``decompress`` needs. Implementations are used as classes (``Compression.fp16.compress(t)``),
    as in Horovod.
    """

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are (any tensor type)."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 (half the bytes); other dtypes pass unchanged.

    ``ctx`` is the original dtype, restored by ``decompress`` when the tensor comes back in another dtype. Values
    beyond float16's range (65504) become inf, so use it for gradients, not for arbitrary sums.

    This class handles numpy arrays. For another tensor type, subclass it and set ``half`` (the framework's float16
    dtype) and override the static methods ``is_floating(dtype)`` and ``cast(tensor, dtype)``.
    """

    half: Any = np.dtype(np.float16)

    @staticmethod
    def is_floating(dtype: Any) -> bool:
        """Whether ``dtype`` is a floating-point dtype (the ones compressed)."""
        return bool(np.issubdtype(dtype, np.floating))

    @staticmethod
    def cast(tensor: Any, dtype: Any) -> Any:
        """``tensor`` converted to ``dtype`` (a new C-contiguous array of the same shape)."""
        return np.asarray(tensor).astype(dtype, order="C")

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, Any]:
        dtype = tensor.dtype
        if cls.is_floating(dtype) and dtype != cls.half:
            return cls.cast(tensor, cls.half), dtype
        return tensor, dtype

    @classmethod
    def decompress(cls, tensor: Any, ctx: Any) -> Any:
        if ctx is not None and tensor.dtype != ctx:
            return cls.cast(tensor, ctx)
        return tensor


class Compression:
    """The available compressors: ``Compression.none`` and ``Compression.fp16``.

    A framework binding subclasses this with its own ``fp16``; ``none`` serves every tensor type.
    """

    none: type[Compressor] = NoneCompressor
    fp16: type[Compressor] = FP16Compressor


def framework_compression(module: str, half: Any, is_floating: Callable[[Any], bool],
                          cast: Callable[[Any, Any], Any]) -> tuple[type[FP16Compressor], type[Compression]]:
    """A binding's ``FP16Compressor`` (``half``: its float16 dtype; ``is_floating(dtype)``; ``cast(tensor,
    dtype)``) and its ``Compression`` with that ``fp16``, both named as classes of ``module`` (the binding's
    ``__name__``, which binds them under these names), so they pickle by reference as classes written there would."""
    fp16 = type("FP16Compressor", (FP16Compressor,), {
        "__module__": module, "__doc__": "Sends floating-point tensors as float16 (half the bytes), restoring the "
                                         "dtype afterwards.",
        "half": half, "is_floating": staticmethod(is_floating), "cast": staticmethod(cast)})
    compression = type("Compression", (Compression,), {
        "__module__": module, "__doc__": "``Compression.none`` and ``Compression.fp16``, as in Horovod.", "fp16": fp16})
    return fp16, compression
