"""The numpy reference of Adasum (the pairwise combination and its tree over ranks), shared by the core's tests of
the collective and the bindings' tests of the Adasum optimizers."""

from __future__ import annotations

import numpy as np


def pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The Adasum of two vectors (float64), written out as in the paper."""
    dot, aa, bb = a @ b, a @ a, b @ b
    ca = 1.0 - dot / (2 * aa) if aa > 0 else 1.0
    cb = 1.0 - dot / (2 * bb) if bb > 0 else 1.0
    return ca * a + cb * b


def tree(vectors: list[np.ndarray]) -> np.ndarray:
    """Ranks' vectors combined pairwise: for N = P + R (P a power of two) ranks 2i and 2i+1 (i < R) first, then
    neighbours, then pairs of pairs (Horovod's reference_tree_reduction for N a power of two)."""
    n = len(vectors)
    p2 = 1 << (n.bit_length() - 1)
    rem = n - p2
    level = [pair(vectors[2 * i], vectors[2 * i + 1]) for i in range(rem)] + list(vectors[2 * rem:])
    while len(level) > 1:
        level = [pair(level[2 * i], level[2 * i + 1]) for i in range(len(level) // 2)]
    return level[0]
