"""Gradient compression for TensorFlow tensors (Horovod's ``hvd.Compression.none`` / ``hvd.Compression.fp16``).

The logic is ``spark_hvd.core.compression``'s; this module only supplies TensorFlow's float16 dtype and cast.
"""

from __future__ import annotations

import tensorflow as tf

from spark_hvd.core.compression import Compressor, NoneCompressor, framework_compression

FP16Compressor, Compression = framework_compression(
    __name__, half=tf.float16, is_floating=lambda dtype: dtype.is_floating, cast=tf.cast)

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
