"""Shared-memory slice collectives (reduce-scatter, allgather) among threads of one process, against numpy.

Each member is a thread with its own ``ShmGroup`` over real /dev/shm segments (the same protocol as between
processes); tiny blocks and few slots make every call run many rounds and reuse every slot.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.ranks import on_threads, shm_groups

from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.backends.ring import even_bounds
from spark_hvd.core.reduce import bf16_to_f32, f32_to_bf16, reference_reduce
from spark_hvd.core.transport import shm_slices
from spark_hvd.core.transport.shm import ShmGroup, shm_available

pytestmark = pytest.mark.skipif(not shm_available(), reason="no usable /dev/shm on this machine")


def _no_peers(operation: str) -> None:
    """Threads of one process: no TCP connections to check."""


def _groups(size: int) -> list[ShmGroup]:
    return shm_groups("slices", size)


def _data(size: int, n: int, dtype: str) -> list[np.ndarray]:
    rng = np.random.default_rng([size, n])
    if dtype == "int32":
        return [rng.integers(-5, 6, n).astype(np.int32) for _ in range(size)]
    values = [(rng.random(n) * 2 + 0.5).astype(np.float32) for _ in range(size)]
    if dtype == "bfloat16":
        return [f32_to_bf16(v, np.empty(n, np.uint16)) for v in values]
    return [v.astype(dtype) for v in values]


@pytest.mark.parametrize("size,n", [(2, 1000), (3, 1001), (4, 3), (3, 0)])
@pytest.mark.parametrize("dtype,op", [("float32", ReduceOp.SUM), ("float64", ReduceOp.MAX),
                                      ("int32", ReduceOp.PRODUCT), ("bfloat16", ReduceOp.SUM)])
def test_reduce_scatter_then_allgather_is_an_allreduce(size, n, dtype, op):
    groups = _groups(size)
    try:
        arrays = _data(size, n, dtype)
        bfloat16 = dtype == "bfloat16"
        want = reference_reduce(arrays, op, bfloat16)
        bounds = even_bounds(n, size)  # with n < size some slices are empty
        bufs = [a.copy() for a in arrays]

        def reduce_scatter(k: int) -> None:
            for _ in range(2):  # twice: the second call starts mid-way through the slots
                bufs[k][...] = arrays[k]
                shm_slices.reduce_scatter(groups[k], bufs[k], bounds, op, bfloat16, "allreduce", _no_peers)

        on_threads(len(groups), reduce_scatter)
        for k in range(size):
            mine = slice(bounds[k], bounds[k + 1])
            got, expect = bufs[k][mine], want[mine]
            if bfloat16:
                got, expect = bf16_to_f32(got), bf16_to_f32(expect)
            np.testing.assert_allclose(got, expect, rtol=1e-6 if dtype != "bfloat16" else 1e-2,
                                       err_msg=f"slice {k}")
            # the other slices are this member's own data, untouched
            rest = np.ones(n, bool)
            rest[mine] = False
            np.testing.assert_array_equal(bufs[k][rest], arrays[k][rest])
        for k in range(size):  # every member's slice made identical everywhere by the allgather
            bufs[k][bounds[k]:bounds[k + 1]] = want[bounds[k]:bounds[k + 1]]
        on_threads(len(groups), lambda k: shm_slices.allgather(groups[k], bufs[k], bounds, "allgather",
                                                                _no_peers))
        for k in range(size):
            np.testing.assert_array_equal(bufs[k], want, err_msg=f"member {k} after the allgather")
    finally:
        for g in groups:
            g.close()


def test_bounds_must_split_the_array():
    groups = _groups(2)
    try:
        with pytest.raises(ValueError, match="do not split 10 elements into 2 slices"):
            shm_slices.allgather(groups[0], np.zeros(10, np.float32), [0, 4, 9], "allgather", _no_peers)
    finally:
        for g in groups:
            g.close()
