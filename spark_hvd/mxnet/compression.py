"""Gradient compression for MXNet NDArrays (Horovod's ``hvd.Compression.none`` / ``hvd.Compression.fp16``).

The logic is ``spark_hvd.core.compression``'s; this module only supplies MXNet's float16 dtype and cast.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from spark_hvd.core import compression as _core
from spark_hvd.core.compression import Compressor, NoneCompressor


class FP16Compressor(_core.FP16Compressor):
    """Sends floating-point NDArrays as float16 (half the bytes), restoring the dtype afterwards."""

    half = np.float16

    @staticmethod
    def is_floating(dtype: Any) -> bool:
        return bool(np.issubdtype(np.dtype(dtype), np.floating))

    @staticmethod
    def cast(tensor: Any, dtype: Any) -> Any:
        return tensor.astype(dtype)


class Compression(_core.Compression):
    """``Compression.none`` and ``Compression.fp16``, as in Horovod."""

    fp16 = FP16Compressor


__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
