"""The helpers in spark_hvd.core.backend that the MPI, torch.distributed and local backends share."""

from __future__ import annotations

import numpy as np
import pytest

from spark_hvd.core.backend import ReduceOp, alltoall_args, as_rows, rank_rows, reducescatter_by_allreduce
from spark_hvd.core.backends.local_backend import LocalBackend
from spark_hvd.core.reduce import reference_reduce


def test_alltoall_args_even_and_given_splits():
    buf = np.arange(24, dtype=np.float32).reshape(6, 4).T.copy().T  # not C-contiguous
    out, splits = alltoall_args(buf, None, 3)
    assert splits == [2, 2, 2] and out.flags.c_contiguous and np.array_equal(out, buf)
    out, splits = alltoall_args(buf, np.array([0, 5, 1]), 3)
    assert splits == [0, 5, 1] and all(type(s) is int for s in splits)
    out, splits = alltoall_args(np.float64(2.5), None, 1)
    assert out.shape == (1,) and splits == [1]


@pytest.mark.parametrize("splits", [[1, 1], [2, 2, 3], [-1, 4, 3], [7, 0, 0]])
def test_alltoall_args_rejects_splits_that_do_not_fit(splits):
    with pytest.raises(ValueError, match="splits"):
        alltoall_args(np.zeros((6, 2)), splits, 3)


def test_alltoall_args_uneven_rows_without_splits():
    with pytest.raises(ValueError, match="divisible by 4"):
        alltoall_args(np.zeros(6), None, 4)


def test_rank_rows_cover_every_row_once():
    for rows in range(0, 12):
        for size in range(1, 6):
            parts = [rank_rows(rows, size, r) for r in range(size)]
            covered = [i for p in parts for i in range(rows)[p]]
            assert covered == list(range(rows))
            lengths = [p.stop - p.start for p in parts]
            assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)


class _SimulatedRank(LocalBackend):
    """One rank of a simulated job: its allreduce is the numpy reference over every rank's contribution."""

    def __init__(self, rank: int, size: int, contributions: list[np.ndarray]) -> None:
        super().__init__()
        self.rank, self.size, self._all = rank, size, contributions

    def allreduce(self, buf: np.ndarray, op: ReduceOp, *, bfloat16: bool = False) -> None:
        buf[...] = reference_reduce(self._all, op)


def test_reducescatter_by_allreduce_against_numpy():
    rng = np.random.default_rng(5)
    size = 3
    data = [rng.random((7, 2)) for _ in range(size)]
    want = np.sum(data, axis=0)
    got = [reducescatter_by_allreduce(_SimulatedRank(r, size, data), data[r], ReduceOp.SUM) for r in range(size)]
    assert [g.shape[0] for g in got] == [3, 2, 2]
    np.testing.assert_allclose(np.concatenate(got), want)
    assert all(not np.shares_memory(g, d) for g, d in zip(got, data, strict=True))


def test_local_backend_alltoall_checks_splits():
    be = LocalBackend()
    out, splits = be.alltoall(np.arange(5))
    assert splits == [5] and np.array_equal(out, np.arange(5))
    with pytest.raises(ValueError, match="splits"):
        be.alltoall(np.arange(5), [4])
    out, splits = be.alltoall(np.array(3.0))
    assert out.shape == () and splits == [1]


def test_as_rows():
    a = np.arange(6.0).reshape(2, 3)
    assert as_rows(a) is a
    t = as_rows(a.T)
    assert t.flags.c_contiguous and np.array_equal(t, a.T)
    assert as_rows(np.array(7)).shape == (1,)
