"""Compression.none / Compression.fp16 on numpy arrays (the one implementation the bindings specialise)."""

from __future__ import annotations

import numpy as np

from spark_hvd.core.compression import Compression, Compressor, FP16Compressor, NoneCompressor


def test_compression_roundtrip():
    x = np.random.default_rng(1).random(100).astype(np.float32)
    c, ctx = Compression.fp16.compress(x)
    assert c.dtype == np.float16
    y = Compression.fp16.decompress(c, ctx)
    assert y.dtype == np.float32 and np.allclose(x, y, atol=1e-3)
    ints = np.arange(5)
    c, ctx = Compression.fp16.compress(ints)
    assert c is ints and Compression.fp16.decompress(c, ctx) is ints
    c, ctx = Compression.none.compress(x)
    assert c is x and Compression.none.decompress(c, ctx) is x


def test_fp16_keeps_shape_and_gives_contiguous_buffers():
    rng = np.random.default_rng(2)
    scalar = np.array(1.5, dtype=np.float64)
    c, ctx = Compression.fp16.compress(scalar)
    assert c.shape == () and c.dtype == np.float16
    assert Compression.fp16.decompress(c, ctx).dtype == np.float64
    t = rng.random((3, 4)).T  # not C-contiguous
    c, ctx = Compression.fp16.compress(t)
    assert c.flags.c_contiguous and c.shape == (4, 3)
    np.testing.assert_allclose(Compression.fp16.decompress(c, ctx), t, atol=1e-3)
    half = rng.random(7).astype(np.float16)
    c, ctx = Compression.fp16.compress(half)
    assert c is half and Compression.fp16.decompress(c, ctx) is half


def test_public_names():
    assert Compression.none is NoneCompressor and Compression.fp16 is FP16Compressor
    assert issubclass(FP16Compressor, Compressor) and issubclass(NoneCompressor, Compressor)
