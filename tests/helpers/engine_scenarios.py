"""Rank-side scenarios of the engine tests, run on every rank of a job (ring, MPI) after ``core.init()``.

Every rank draws every rank's data from the same seeds, so each can compute the expected result with numpy.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

import spark_hvd.core as core
from spark_hvd.core.reduce import ELEMENTWISE_OPS, reference_reduce

ReduceOp = core.ReduceOp
DTYPES = (np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8)


def _data(seed: int, r: int, shape: tuple[int, ...], dtype) -> np.ndarray:
    rng = np.random.default_rng([seed, r])
    if np.dtype(dtype).kind == "f":
        return (rng.standard_normal(shape) * 4).astype(dtype)
    hi = 4 if np.dtype(dtype) == np.uint8 else 50
    return rng.integers(0 if np.dtype(dtype).kind == "u" else -hi, hi, size=shape).astype(dtype)


def _check(got: np.ndarray, want: np.ndarray, what: str) -> None:
    tol = {np.dtype(np.float16): 2e-2, np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}.get(got.dtype)
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.shape}/{got.dtype} vs {want.shape}"
    if tol is None:
        np.testing.assert_array_equal(got, want, err_msg=what)
    else:
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol, err_msg=what)


def collectives(seed: int = 0, full_matrix: bool = True) -> int:
    """Every collective and dtype/op against numpy on fresh random data.

    ``full_matrix=False``: every op on float32 and float64, the other dtypes with SUM only (for the larger N).
    """
    n, r = core.size(), core.rank()
    checked = 0
    for di, dtype in enumerate(DTYPES):
        for oi, op in enumerate(ELEMENTWISE_OPS):
            if op is ReduceOp.PRODUCT and np.dtype(dtype).kind != "f":
                continue
            if not full_matrix and dtype not in (np.float32, np.float64) and op is not ReduceOp.SUM:
                continue
            shape = (7 + di, 3)
            s = seed * 1000 + di * 10 + oi
            datas = [_data(s, q, shape, dtype) for q in range(n)]
            buf = datas[r].copy()
            core.allreduce(buf, name=f"ar.{dtype.__name__}.{op.value}", op=op)
            _check(buf, reference_reduce(datas, op), f"allreduce {dtype.__name__} {op.value}")
            checked += 1
    # prescale / postscale
    datas = [_data(seed + 1, q, (33,), np.float64) for q in range(n)]
    buf = datas[r].copy()
    core.allreduce(buf, name="scaled", op=ReduceOp.SUM, prescale=0.5, postscale=3.0)
    _check(buf, sum(datas) * 1.5, "scaled allreduce")
    # bfloat16 as uint16 bits
    floats = [_data(seed + 2, q, (20,), np.float32) for q in range(n)]
    bits = [(f.view(np.uint32) >> 16).astype(np.uint16) for f in floats]
    buf = bits[r].copy()
    core.allreduce(buf, name="bf16", op=ReduceOp.SUM, bfloat16=True)
    _check(buf, reference_reduce(bits, ReduceOp.SUM, bfloat16=True), "bfloat16 allreduce")
    # empty tensors and scalars
    e = np.zeros((0, 4), np.float32)
    core.allreduce(e, name="empty")
    scalar = np.array(float(r + 1))
    core.allreduce(scalar, name="scalar", op=ReduceOp.SUM)
    assert float(scalar) == n * (n + 1) / 2
    # grouped
    datas = [[_data(seed + 3, q * 10 + i, (5 + i,), np.float32) for i in range(4)] for q in range(n)]
    bufs = [d.copy() for d in datas[r]]
    core.grouped_allreduce(bufs, op=ReduceOp.AVERAGE)
    for i in range(4):
        _check(bufs[i], reference_reduce([datas[q][i] for q in range(n)], ReduceOp.AVERAGE), f"grouped {i}")
    # allgather, first dimension differing by rank
    datas = [_data(seed + 4, q, (q + 1, 3), np.float32) for q in range(n)]
    _check(core.allgather(datas[r], name="ag"), np.concatenate(datas), "allgather")
    # broadcast from every root
    for root in range(n):
        datas = [_data(seed + 5 + root, q, (6, 2), np.int64) for q in range(n)]
        buf = datas[r].copy()
        core.broadcast(buf, root, name=f"bc.{root}")
        _check(buf, datas[root], f"broadcast root {root}")
    # alltoall with splits
    splits = [[(q + k) % 3 for k in range(n)] for q in range(n)]
    datas = [_data(seed + 6, q, (sum(splits[q]), 2), np.float64) for q in range(n)]
    out, recv = core.alltoall(datas[r], splits=splits[r], name="a2a")
    want = []
    for q in range(n):
        start = sum(splits[q][:r])
        want.append(datas[q][start:start + splits[q][r]])
    _check(out, np.concatenate(want), "alltoall")
    assert recv == [splits[q][r] for q in range(n)]
    # reducescatter (rows not divisible by size)
    rows = 2 * n + 1
    datas = [_data(seed + 7, q, (rows, 3), np.float32) for q in range(n)]
    full = reference_reduce(datas, ReduceOp.SUM)
    base, extra = divmod(rows, n)
    start = r * base + min(r, extra)
    stop = start + base + (1 if r < extra else 0)
    _check(core.reducescatter(datas[r], op=ReduceOp.SUM, name="rs"), full[start:stop], "reducescatter")
    # objects
    assert core.broadcast_object({"from": r, "x": [1, 2]} if r == 0 else None, 0) == {"from": 0, "x": [1, 2]}
    assert core.allgather_object(("rank", r)) == [("rank", q) for q in range(n)]
    core.barrier()
    return checked


def different_orders(seed: int = 1, count: int = 24) -> None:
    """Named tensors submitted in a different order on every rank still meet."""
    n, r = core.size(), core.rank()
    order = np.random.default_rng([seed, r]).permutation(count)
    datas = {i: [_data(seed * 100 + i, q, (i + 1,), np.float32) for q in range(n)] for i in range(count)}
    bufs = {int(i): datas[int(i)][r].copy() for i in order}
    handles = {i: core.allreduce_async(bufs[i], name=f"ord.{i}", op=ReduceOp.SUM) for i in bufs}
    for i in reversed(list(handles)):
        core.synchronize(handles[i])
        _check(bufs[i], reference_reduce(datas[i], ReduceOp.SUM), f"tensor ord.{i}")


def cached_partial_rounds(seed: int = 5, count: int = 20, passes: int = 3) -> dict:
    """Cached names submitted in a different order per rank, rank 1 waiting after every 5th: rounds in which
    the ranks sent different subsets of cached ids (some ready at once, the rest outstanding) stay correct."""
    n, r = core.size(), core.rank()
    stats = core.get_engine().stats
    before = stats["cache_hits"]
    for p in range(passes):
        order = np.random.default_rng([seed, p, r]).permutation(count)
        datas = {i: [_data(seed * 1000 + p * 100 + i, q, (i + 3,), np.float32) for q in range(n)]
                 for i in range(count)}
        bufs = {int(i): datas[int(i)][r].copy() for i in order}
        handles = {}
        for k, i in enumerate(bufs):
            handles[i] = core.allreduce_async(bufs[i], name=f"partial.{i}")
            if r == 1 and k % 5 == 4:  # one waiting rank only: two could wait on each other
                core.synchronize(handles[i])
        for i, h in handles.items():
            core.synchronize(h)
            _check(bufs[i], reference_reduce(datas[i], ReduceOp.AVERAGE), f"pass {p} tensor partial.{i}")
    return {"cache_hits": stats["cache_hits"] - before}


def fusion(count: int = 100) -> dict:
    """Many small tensors: fewer collectives than tensors, and one fusion group per threshold's worth."""
    n, r = core.size(), core.rank()
    stats = core.get_engine().stats
    before = dict(stats)
    datas = [[_data(777 + i, q, (50,), np.float32) for q in range(n)] for i in range(count)]
    bufs = [d[r].copy() for d in datas]
    handles = [core.allreduce_async(b, name=f"fuse.{i}") for i, b in enumerate(bufs)]
    for i, h in enumerate(handles):
        core.synchronize(h)
        _check(bufs[i], reference_reduce(datas[i], ReduceOp.AVERAGE), f"fused tensor {i}")
    return {k: stats[k] - before.get(k, 0) for k in ("allreduce_collectives", "allreduce_tensors",
                                                      "fused_collectives", "cache_hits", "rounds")}


def mismatch() -> list[str]:
    """Shape, dtype and op mismatches raise TensorMismatchError on every rank; the engine goes on."""
    n, r = core.size(), core.rank()
    errors = []
    cases = {
        "bad_shape": lambda: core.allreduce(np.ones(4 + (r == n - 1)), name="bad_shape"),
        "bad_dtype": lambda: core.allreduce(np.ones(4, np.float32 if r else np.float64), name="bad_dtype"),
        "bad_op": lambda: core.allreduce(np.ones(4), name="bad_op", op=ReduceOp.SUM if r else ReduceOp.MAX),
    }
    for name, call in cases.items():
        try:
            call()
        except core.TensorMismatchError as exc:
            assert exc.name == name, exc
            assert exc.ranks, exc
            assert name in str(exc) and "rank" in str(exc)
            errors.append(str(exc))
        else:
            raise AssertionError(f"no TensorMismatchError for {name} on rank {r}")
    buf = np.full(3, float(r))
    core.allreduce(buf, name="after_mismatch", op=ReduceOp.SUM)
    assert np.all(buf == sum(range(n)))
    return errors


def join_uneven(seed: int = 5) -> int:
    """Rank r runs 2 + r steps, then joins; joined ranks contribute zeros; join returns the last rank."""
    n, r = core.size(), core.rank()
    steps = [2 + q for q in range(n)]
    for i in range(steps[r]):
        datas = [_data(seed * 100 + i, q, (9,), np.float64) for q in range(n)]
        buf = datas[r].copy()
        core.allreduce(buf, name=f"step.{i}", op=ReduceOp.AVERAGE)
        want = sum(datas[q] for q in range(n) if steps[q] > i) / n
        _check(buf, want, f"step {i} on rank {r}")
    last = core.join()
    assert last == n - 1, last
    buf = np.full(2, 1.0)
    core.allreduce(buf, name="after_join", op=ReduceOp.SUM)
    assert np.all(buf == n)
    return last


class _Catch(logging.Handler):
    def __init__(self, needle: str) -> None:
        super().__init__(logging.WARNING)
        self.needle = needle
        self.seen = threading.Event()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if self.needle in message:
            self.messages.append(message)
            self.seen.set()


def stall() -> str:
    """Rank 0 submits 'lonely' alone: after the stall time a warning names it and the missing ranks."""
    n, r = core.size(), core.rank()
    catcher = _Catch("'lonely'")
    logging.getLogger("spark_hvd.core.engine.engine").addHandler(catcher)
    try:
        go = np.zeros(1)
        if r == 0:
            h = core.allreduce_async(np.ones(2), name="lonely", op=ReduceOp.SUM)
            assert catcher.seen.wait(60), "no stall warning within 60 s"
            core.allreduce(go, name="go")
            assert np.all(core.synchronize(h) == n)
        else:
            core.allreduce(go, name="go")
            core.allreduce(np.ones(2), name="lonely", op=ReduceOp.SUM)
        return catcher.messages[0] if catcher.messages else ""
    finally:
        logging.getLogger("spark_hvd.core.engine.engine").removeHandler(catcher)


def join_other_ops(seed: int = 9) -> int:
    """Rank 0 joins at once; on the others allgather, alltoall, reducescatter and broadcast fail (as in Horovod)
    naming rank 0, and an allreduce right after each still gives the sum of the active ranks."""
    n, r = core.size(), core.rank()
    if r == 0:
        return core.join()
    active = list(range(1, n))
    ops = {
        "allgather": lambda: core.allgather(_data(seed, r, (r, 2), np.float32), name="j.ag"),
        "alltoall": lambda: core.alltoall(np.zeros((n, 2), np.float32), name="j.a2a"),
        "reducescatter": lambda: core.reducescatter(np.ones((2 * n, 3)), op=ReduceOp.SUM, name="j.rs"),
        "broadcast": lambda: core.broadcast(np.zeros(4, np.int64), 1, name="j.bc"),
    }
    for i, (kind, call) in enumerate(ops.items()):
        try:
            call()
        except core.TensorMismatchError as exc:
            assert f"{kind} of 'j." in str(exc) and "rank 0 has called join()" in str(exc), str(exc)
            assert exc.ranks == [0], exc.ranks
        else:
            raise AssertionError(f"{kind} while rank 0 has joined did not raise")
        datas = [_data(seed + 1 + i, q, (5,), np.float64) for q in range(n)]
        got = core.allreduce(datas[r].copy(), op=ReduceOp.SUM, name=f"j.after.{kind}")
        _check(got, reference_reduce([datas[q] for q in active], ReduceOp.SUM), f"allreduce after {kind} w/ join")
    return core.join()
