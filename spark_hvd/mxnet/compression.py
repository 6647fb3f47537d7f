"""Gradient compression for MXNet NDArrays (Horovod's ``hvd.Compression.none`` / ``hvd.Compression.fp16``).

The logic is ``spark_hvd.core.compression``'s; this module only supplies MXNet's float16 dtype and cast.
"""

from __future__ import annotations

import numpy as np

from spark_hvd.core.compression import Compressor, NoneCompressor, framework_compression

FP16Compressor, Compression = framework_compression(
    __name__, half=np.float16, is_floating=lambda dtype: bool(np.issubdtype(np.dtype(dtype), np.floating)),
    cast=lambda tensor, dtype: tensor.astype(dtype))

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
