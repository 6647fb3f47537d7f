"""Gradient compression for torch tensors (Horovod's ``hvd.Compression.none`` / ``hvd.Compression.fp16``).

The logic is ``spark_hvd.core.compression``'s; this module only supplies torch's float16 dtype and cast.
"""

from __future__ import annotations

import torch

from spark_hvd.core.compression import Compressor, NoneCompressor, framework_compression

FP16Compressor, Compression = framework_compression(
    __name__, half=torch.float16, is_floating=lambda dtype: dtype.is_floating_point,
    cast=lambda tensor, dtype: tensor.to(dtype))

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
