"""Gradient compression for allreduce: none, or float16 on the wire (Horovod's ``hvd.Compression``)."""

from __future__ import annotations

from typing import Any

import numpy as np


class Compressor:
    """Turns an array into what is reduced, and back. ``ctx`` carries what ``decompress`` needs."""

    @staticmethod
    def compress(arr: np.ndarray) -> tuple[np.ndarray, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(arr: np.ndarray, ctx: Any) -> np.ndarray:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Leaves arrays as they are."""

    @staticmethod
    def compress(arr: np.ndarray) -> tuple[np.ndarray, Any]:
        return arr, None

    @staticmethod
    def decompress(arr: np.ndarray, ctx: Any) -> np.ndarray:
        return arr


class FP16Compressor(Compressor):
    """Sends floating-point arrays as float16 (half the bytes); other dtypes pass unchanged.

    ``ctx`` is the original dtype, restored by ``decompress``. Values beyond float16's range (65504) become inf,
    so use it for gradients, not for arbitrary sums.
    """

    @staticmethod
    def compress(arr: np.ndarray) -> tuple[np.ndarray, Any]:
        dtype = arr.dtype
        if np.issubdtype(dtype, np.floating) and dtype != np.float16:
            return np.ascontiguousarray(arr, dtype=np.float16), dtype
        return arr, None

    @staticmethod
    def decompress(arr: np.ndarray, ctx: Any) -> np.ndarray:
        if ctx is None:
            return arr
        return arr.astype(ctx)


class Compression:
    """The available compressors: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
