"""hvd.Compression of the torch and Keras (TensorFlow) bindings: the core implementation with each framework's cast,
checked in process against the uncompressed tensors."""

from __future__ import annotations

import numpy as np
import pytest

from spark_hvd.core import compression as core_compression


def test_torch_compression():
    torch = pytest.importorskip("torch")
    from spark_hvd.torch import Compression
    from spark_hvd.torch.compression import FP16Compressor

    assert Compression.fp16 is FP16Compressor and issubclass(FP16Compressor, core_compression.FP16Compressor)
    assert Compression.none is core_compression.NoneCompressor
    x = torch.from_numpy(np.random.default_rng(3).random((5, 4))).requires_grad_()  # float64
    c, ctx = Compression.fp16.compress(x)
    assert c.dtype == torch.float16 and c.shape == x.shape and c.requires_grad
    y = Compression.fp16.decompress(c, ctx)
    assert y.dtype == torch.float64
    np.testing.assert_allclose(y.detach().numpy(), x.detach().numpy(), atol=1e-3)
    for t in (torch.arange(6), torch.ones(3, dtype=torch.float16)):
        c, ctx = Compression.fp16.compress(t)
        assert c is t and Compression.fp16.decompress(c, ctx) is t
    c, ctx = Compression.none.compress(x)
    assert c is x and Compression.none.decompress(c, ctx) is x


def test_tensorflow_compression():
    tf = pytest.importorskip("tensorflow")
    from spark_hvd.keras.compression import Compression, FP16Compressor

    assert Compression.fp16 is FP16Compressor and issubclass(FP16Compressor, core_compression.FP16Compressor)
    x_np = np.random.default_rng(4).random((5, 4)).astype(np.float32)
    x = tf.constant(x_np)
    c, ctx = Compression.fp16.compress(x)
    assert c.dtype == tf.float16 and tuple(c.shape) == (5, 4)
    y = Compression.fp16.decompress(c, ctx)
    assert y.dtype == tf.float32
    np.testing.assert_allclose(y.numpy(), x_np, atol=1e-3)
    ints = tf.range(6)
    c, ctx = Compression.fp16.compress(ints)
    assert c is ints and Compression.fp16.decompress(c, ctx) is ints
    c, ctx = Compression.none.compress(x)
    assert c is x and Compression.none.decompress(c, ctx) is x
