"""Adasum (``spark_hvd.core.algorithms.adasum``) against a numpy reference of the pairwise tree on random data: the
algorithm on the ring backend at N = 2, 3, 4, 5 (shared memory and TCP), every float dtype, several fused tensors of
sizes smaller and larger than N; through the engine (``op=Adasum``, grouped, prescale, a joined rank); the errors."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.adasum import pair, tree
from helpers.ranks import backend_from_env, run_ranks

import spark_hvd.core as core
from spark_hvd.core.algorithms import adasum
from spark_hvd.core.reduce import bf16_to_f32, f32_to_bf16

SIZES = [1, 3, 64, 1001]  # fewer elements than ranks, odd splits, a few thousand
TCP = {"SPARK_HVD_SHM": "0", "SPARK_HVD_TIMEOUT": "60"}


def _data(seed: int, rank: int, size: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng([seed, rank, size])
    values = rng.standard_normal(size) + (0.5 if rank % 2 else -0.2)  # correlated, not parallel
    if dtype == "bfloat16":
        return f32_to_bf16(values.astype(np.float32), np.empty(size, np.uint16))
    return values.astype(dtype)


def _wide(a: np.ndarray, dtype: str) -> np.ndarray:
    return bf16_to_f32(a).astype(np.float64) if dtype == "bfloat16" else a.astype(np.float64)


def _algorithm_job(seed: int) -> list[str]:
    be = backend_from_env()
    n, r = be.size, be.rank
    checked = []
    try:
        for dtype in ("float32", "float64", "float16", "bfloat16"):
            datas = [[_data(seed + i, q, s, dtype) for i, s in enumerate(SIZES)] for q in range(n)]
            bufs = [d.copy() for d in datas[r]]
            adasum.allreduce(be, bufs, bfloat16=dtype == "bfloat16")
            rtol = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
            for i in range(len(SIZES)):
                want = tree([_wide(datas[q][i], dtype) for q in range(n)])
                got = _wide(bufs[i], dtype)
                np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max(),
                                           err_msg=f"{dtype} tensor {i} rank {r}")
                if SIZES[i] > 1:  # (of scalars Adasum is the mean) neither the mean nor the sum
                    total = sum(_wide(datas[q][i], dtype) for q in range(n))
                    assert not np.allclose(want, total / n) and not np.allclose(want, total)
            checked.append(dtype)
        # the same bits on every rank
        digest = be.allgather(np.frombuffer(b"".join(b.tobytes() for b in bufs)[:64].ljust(64, b"\0"), np.uint8))
        assert all((row == digest[:64]).all() for row in digest.reshape(n, 64))
    finally:
        be.close()
    return checked


@pytest.mark.parametrize("n,env", [(2, {}), (3, TCP), (4, {}), (5, TCP)])
def test_adasum_matches_the_pairwise_tree(n, env):
    assert run_ranks(_algorithm_job, n, env=env, args=(n,), timeout=170) == [
        ["float32", "float64", "float16", "bfloat16"]] * n


def test_pair_properties():
    rng = np.random.default_rng(0)
    a = rng.standard_normal(50)
    b = rng.standard_normal(50)
    b -= (a @ b) / (a @ a) * a  # orthogonal: they add
    np.testing.assert_allclose(pair(a, b), a + b)
    np.testing.assert_allclose(pair(a, a), a)  # equal: the mean
    np.testing.assert_allclose(pair(a, 0 * a), a)  # a joined rank's zeros change nothing
    cl, cr = adasum.coefficients(np.float64(a @ b), np.float64(a @ a), np.float64(0.0))
    assert (float(cl), float(cr)) == (pytest.approx(1.0), 1.0)


def _engine_job() -> dict:
    core.init()
    try:
        n, r = core.size(), core.rank()
        datas = [[_data(7, q, s, "float32") for s in (5, 300)] for q in range(n)]
        # one tensor, blocking
        buf = datas[r][1].copy()
        core.allreduce(buf, name="one", op=core.Adasum)
        np.testing.assert_allclose(buf, tree([d[1].astype(np.float64) for d in datas]), rtol=1e-5, atol=1e-5)
        # grouped (fused into one collective): each tensor keeps its own coefficients; prescale / postscale
        bufs = [d.copy() for d in datas[r]]
        core.grouped_allreduce(bufs, names=["g0", "g1"], op=core.Adasum, prescale=0.5, postscale=3.0)
        for i in range(2):
            want = 3.0 * tree([0.5 * d[i].astype(np.float64) for d in datas])
            np.testing.assert_allclose(bufs[i], want, rtol=1e-5, atol=1e-5)
        # a rank that has joined contributes zeros: the others' tree with rank 0's vector left out at its leaf
        if r == 0:
            core.join()
        else:
            mine = datas[r][0].copy()
            core.allreduce(mine, name="after_join", op=core.Adasum)
            vectors = [np.zeros(5)] + [d[0].astype(np.float64) for d in datas[1:]]
            np.testing.assert_allclose(mine, tree(vectors), rtol=1e-5, atol=1e-5)
            core.join()
        errors = []
        for bad in (lambda: core.allreduce(np.arange(4), name="ints", op=core.Adasum),
                    lambda: core.reducescatter(np.ones(4, np.float32), name="rs", op=core.Adasum)):
            try:
                bad()
            except (TypeError, NotImplementedError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
        return {"errors": errors}
    finally:
        core.shutdown()


def test_adasum_through_the_engine():
    reports = run_ranks(_engine_job, 2, env={"SPARK_HVD_TIMEOUT": "60"}, timeout=170)
    errors = reports[0]["errors"]
    assert errors[0].startswith("TypeError: allreduce of 'ints': op=Adasum needs a floating-point tensor")
    assert errors[1].startswith("NotImplementedError: reducescatter of 'rs': op=Adasum is supported by allreduce")
    assert reports[1] == reports[0]
