"""Gradient compression for TensorFlow tensors (Horovod's ``hvd.Compression.none`` / ``hvd.Compression.fp16``).

The logic is ``spark_hvd.core.compression``'s; this module only supplies TensorFlow's float16 dtype and cast.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from spark_hvd.core import compression as _core
from spark_hvd.core.compression import Compressor, NoneCompressor


class FP16Compressor(_core.FP16Compressor):
    """Sends floating-point tensors as float16 (half the bytes), restoring the dtype afterwards."""

    half = tf.float16

    @staticmethod
    def is_floating(dtype: tf.DType) -> bool:
        return dtype.is_floating

    @staticmethod
    def cast(tensor: tf.Tensor, dtype: Any) -> tf.Tensor:
        return tf.cast(tensor, dtype)


class Compression(_core.Compression):
    """``Compression.none`` and ``Compression.fp16``, as in Horovod."""

    fp16 = FP16Compressor


__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
