"""The compiled ring loop's reductions (``spark_hvd/core/transport/_ringloop.c``) bit for bit against the Python
loop's (``RingBackend._ring`` reducing with ``spark_hvd.core.reduce``): every element-wise op of every dtype the
ring takes, float16 and bfloat16 included, on random data (random bit patterns for the 16-bit floats: subnormals,
infinities and NaNs among them). Two ranks on one socket pair run a reduce-scatter step and an allgather step, in
several frames, once with the compiled loop on both and once with the Python loop on both."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.reduce import ELEMENTWISE_OPS
from spark_hvd.core.transport import ringloop
from tests.helpers.ring_loops import python_loop, socket_pair

pytestmark = pytest.mark.skipif(not ringloop.BUILT, reason="the compiled ring loop is not built here")

FRAME = 4096  # bytes: several frames per chunk
DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
          "uint64"]


def _plan(p: int, bounds: list[int]) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
    """Ring position ``p`` of 2: its first frames and its receive plan (one reduce step, one gather step), as
    ``RingBackend._ring`` makes them."""
    def pieces(chunk: int) -> list[tuple[int, int]]:
        lo, hi = bounds[chunk], bounds[chunk + 1]
        return [(at, min(hi, at + FRAME)) for at in range(lo, hi, FRAME)]

    return pieces((p - 1) % 2), [(t, lo, hi) for t in range(2) for lo, hi in pieces((p - t - 2) % 2)]


def _data(dtype: str, rng: np.random.Generator, count: int) -> np.ndarray:
    if dtype in ("float16", "bfloat16"):  # any bit pattern (bfloat16 as its uint16 view)
        bits = rng.integers(0, 1 << 16, count, dtype=np.uint16)
        return bits.view(np.float16) if dtype == "float16" else bits
    if dtype in ("float32", "float64"):
        values = rng.standard_normal(count) * 10.0 ** rng.uniform(-30, 30, count)
        values[rng.integers(0, count, 40)] = rng.choice([0.0, -0.0, np.inf, -np.inf, 1e300], 40)
        with np.errstate(over="ignore"):  # float32: the largest ones become infinities
            return values.astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_loop_reduces_as_the_python_loop_bit_for_bit(dtype):
    bfloat16 = dtype == "bfloat16"
    rng = np.random.default_rng(DTYPES.index(dtype))
    count = 10_001
    data = [_data(dtype, rng, count) for _ in range(2)]
    item = data[0].itemsize
    bounds = [0, count // 2 * item, count * item]
    plans = [_plan(r, bounds) for r in range(2)]
    peers = socket_pair()
    try:
        for op in ELEMENTWISE_OPS:
            assert ringloop.supports(data[0].dtype, op, bfloat16, 1)
            results = {}
            for loop in ("compiled", "python"):
                flats = [d.copy() for d in data]
                errors: list[BaseException] = []

                def rank(r: int, loop: str = loop, flats: list = flats, errors: list = errors,
                         op: ReduceOp = op) -> None:
                    try:
                        if loop == "compiled":
                            ringloop.run(peers[r], peers[r], "test", flats[r], np.empty(FRAME, np.uint8), *plans[r],
                                         1, 2, op, 2, bfloat16=bfloat16)
                        else:
                            with np.errstate(all="ignore"):  # sums and products of random values overflow
                                python_loop(peers[r], flats[r], *plans[r], op, bfloat16, FRAME)
                    except BaseException as exc:  # re-raised below
                        errors.append(exc)

                threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(30)
                assert not errors, errors
                results[loop] = [f.view(np.uint8) for f in flats]
            for r in range(2):
                np.testing.assert_array_equal(results["compiled"][r], results["python"][r],
                                              err_msg=f"{dtype} {op.name} rank {r}")
    finally:
        for peer in peers:
            peer.sock.close()


def test_compiled_loop_divides_only_where_the_ring_averages():
    # a reduce-scatter of an AVERAGE leaves the division to its caller (``RingBackend.reducescatter``):
    # ``average=False`` sums, as the Python loop does there
    data = [np.arange(1, 4097, dtype=np.float32), np.full(4096, 3, np.float32)]
    bounds = [0, 2048 * 4, 4096 * 4]
    plans = [_plan(r, bounds) for r in range(2)]
    peers = socket_pair()
    try:
        flats = [d.copy() for d in data]
        threads = [threading.Thread(target=ringloop.run, args=(peers[r], peers[r], "test", flats[r],
                                                               np.empty(FRAME, np.uint8), *plans[r], 1, 2,
                                                               ReduceOp.AVERAGE, 2), kwargs={"average": False})
                   for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for flat in flats:
            np.testing.assert_array_equal(flat, data[0] + data[1])
    finally:
        for peer in peers:
            peer.sock.close()
