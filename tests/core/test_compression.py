"""Compression.none / Compression.fp16."""

from __future__ import annotations

import numpy as np

from spark_hvd.core.compression import Compression


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
