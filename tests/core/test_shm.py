"""``ShmGroup.allreduce``'s block pipeline (``spark_hvd.core.transport.shm``) on its own: members on threads of one
process, tiny blocks and few slots, so every path of ``_BlockAllreduce`` runs many times (two members straight
from the peer's slot, small blocks reduced in full, larger ones reduce-scattered and gathered; slots reused)."""

from __future__ import annotations

import numpy as np
import pytest

from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.transport.shm import shm_available
from tests.helpers.ranks import on_threads, shm_groups

pytestmark = pytest.mark.skipif(not shm_available(), reason="no /dev/shm here")


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MAX])
def test_block_allreduce_matches_numpy_over_many_blocks(size, op):
    # 256-byte blocks, 3 slots: 1001 float32 (+ a second array) are ~17 blocks, the last one short (small-block
    # path at 3 members); ``profile`` on the second call times copy-in and finish without changing the result
    groups = shm_groups(f"blocks{size}{op.name}", size)
    rng = np.random.default_rng(size)
    data = [[rng.integers(-50, 50, n).astype(np.float32) for n in (1001, 37)] for _ in range(size)]
    reduce = {ReduceOp.SUM: np.add, ReduceOp.AVERAGE: np.add, ReduceOp.MAX: np.maximum}[op]
    expected = []
    for i in range(2):
        total = data[0][i].copy()
        for k in range(1, size):
            total = reduce(total, data[k][i])
        expected.append(total / size if op is ReduceOp.AVERAGE else total)
    results: list = [None] * size

    def member(k: int) -> None:
        for call in range(2):
            groups[k].profile = {} if call else None
            segs = [a.copy() for a in data[k]]
            groups[k].allreduce(segs, op, False, "allreduce", lambda operation: None)
            results[k] = segs
        assert groups[k].profile["blocks"] > 10 and groups[k].profile["finish"] > 0

    try:
        on_threads(size, member)
    finally:
        for g in groups:
            g.close()
    for segs in results:
        for got, want in zip(segs, expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-6)
