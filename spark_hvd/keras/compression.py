"""Gradient compression for the Keras TensorFlow backend: ``spark_hvd.tensorflow.compression``'s."""

from spark_hvd.tensorflow.compression import Compression, Compressor, FP16Compressor, NoneCompressor

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
