"""Rounds of tensors the ranks have not negotiated before (new names, unnamed calls): when every rank submits the
same, no rank's message travels (the fast round's digests agree); after two such rounds of one layout the next is
one collective (``spark_hvd.core.engine.fresh``); every result still matches numpy, and ranks that submit in different
orders, other names or differently still meet or fail as before, naming the tensor and the rank."""

from __future__ import annotations

import helpers.engine_scenarios as sc
import numpy as np
import pytest
from helpers.ranks import run_ranks

import spark_hvd.core as core
from spark_hvd.core.engine.fresh import FreshSpec, agreed, build_fresh, fresh_layout, pack, unpack
from spark_hvd.core.engine.negotiation import Meta
from spark_hvd.core.errors import TensorMismatchError
from spark_hvd.core.reduce import reference_reduce

ReduceOp = core.ReduceOp

_TENSORS = (("a", (6,), np.float32, ReduceOp.SUM), ("b", (3, 5), np.float64, ReduceOp.AVERAGE),
            ("c", (4,), np.int32, ReduceOp.MAX))


def _round(seed: int, names: list[str], order: list[int]) -> None:
    """Submit ``_TENSORS`` under ``names`` in ``order`` (asynchronously), wait, compare with numpy."""
    n, r = core.size(), core.rank()
    datas = [[sc._data(seed + k, q, shape, dtype) for q in range(n)] for k, (_, shape, dtype, _) in
             enumerate(_TENSORS)]
    bufs = [d[r].copy() for d in datas]
    handles = {k: core.allreduce_async(bufs[k], name=names[k], op=_TENSORS[k][3]) for k in order}
    for k in order:
        handles[k].wait()
    for k, (label, _, dtype, op) in enumerate(_TENSORS):
        sc._check(bufs[k], reference_reduce(datas[k], op).astype(dtype), f"{names[k]} ({label})")


def _blocking(name: str, seed: int, shape: tuple[int, ...], dtype, op: ReduceOp, **scale: float) -> None:
    n, r = core.size(), core.rank()
    datas = [sc._data(seed, q, shape, dtype) for q in range(n)]
    buf = datas[r].copy()
    core.allreduce(buf, name=name, op=op, **scale)
    want = reference_reduce([d * scale.get("prescale", 1.0) for d in datas], op) * scale.get("postscale", 1.0)
    sc._check(buf, want.astype(dtype), f"{name} {op.value}")


def _new_names_job(seed: int) -> dict:
    core.init()
    try:
        n, r = core.size(), core.rank()
        engine = core.get_engine()
        # 1. every round the same new names in the same order on every rank, one of them cached after round 0
        for i in range(8):
            _round(seed + 10 * i, ["cached", f"new{i}.b", f"new{i}.c"], [0, 1, 2])
        agreed = engine.stats["messages_skipped"]
        # 2. the same new names in another order on rank 0: the messages differ and travel; the tensors still meet
        before = engine.stats["messages_skipped"]
        _round(seed + 100, ["x.a", "x.b", "x.c"], [2, 0, 1] if r == 0 else [0, 1, 2])
        travelled = engine.stats["messages_skipped"] == before
        # 3. unnamed blocking allreduces: a new name every call
        for i in range(6):
            datas = [sc._data(seed + 200 + i, q, (9,), np.float64) for q in range(n)]
            buf = datas[r].copy()
            core.allreduce(buf, op=ReduceOp.SUM)
            sc._check(buf, reference_reduce(datas, ReduceOp.SUM), f"unnamed {i}")
        hits = engine.stats["fresh_rounds"] - engine.stats["fresh_misses"]
        # 3b. new names every call, AVERAGE with scaling: after two agreed rounds, one collective each
        for i in range(6):
            _blocking(f"avg{i}", seed + 220 + i, (5, 3), np.float32, ReduceOp.AVERAGE, prescale=0.5, postscale=3.0)
        # 3c. armed for one float64 (9,) tensor; rank 0 submits 'q' before 'p', the others 'p' then 'q': the
        # speculation misses (other names or another layout) and both still meet and match numpy
        for i in range(3):
            _blocking(f"arm{i}", seed + 240 + i, (9,), np.float64, ReduceOp.SUM)
        misses = engine.stats["fresh_misses"]
        dp, dq = ([sc._data(seed + k, q, (9,), np.float64) for q in range(n)] for k in (250, 251))
        bp, bq = dp[r].copy(), dq[r].copy()
        if r == 0:
            handle = core.allreduce_async(bq, name="q", op=ReduceOp.SUM)
            core.allreduce(bp, name="p", op=ReduceOp.SUM)
            handle.wait()
        else:
            core.allreduce(bp, name="p", op=ReduceOp.SUM)
            core.allreduce(bq, name="q", op=ReduceOp.SUM)
        sc._check(bp, reference_reduce(dp, ReduceOp.SUM), "p")
        sc._check(bq, reference_reduce(dq, ReduceOp.SUM), "q")
        missed = engine.stats["fresh_misses"] > misses
        hits = engine.stats["fresh_rounds"] - engine.stats["fresh_misses"] - hits
        # 4. a new name with another shape on the last rank: a mismatch naming it on every rank, then in step
        shape = (5,) if r == n - 1 else (4,)
        error = ""
        try:
            core.allreduce(np.ones(shape, np.float32), name="odd", op=ReduceOp.SUM)
        except TensorMismatchError as exc:
            error = f"{exc.name} {exc.ranks}"
        _round(seed + 300, ["after.a", "after.b", "after.c"], [0, 1, 2])
        return {"agreed": agreed, "travelled": travelled, "error": error, "missed": missed, "hits": hits,
                "stats": dict(engine.stats)}
    finally:
        core.shutdown()


@pytest.mark.parametrize("n", [2, 3])
def test_new_names_on_every_rank_need_no_message_and_match_numpy(n):
    results = run_ranks(_new_names_job, n, env={"SPARK_HVD_TIMEOUT": "60"}, args=(11 * n,), timeout=150)
    for res in results:
        # pacing may split a burst of submissions differently on different ranks (their messages then travel),
        # and a blocking call may meet a peer's heartbeat round, but not in every one of these rounds
        assert res["agreed"] >= 1 and res["stats"]["messages_skipped"] > res["agreed"], res["stats"]
        assert res["travelled"], res["stats"]
        assert res["error"] == f"odd [{n - 1}]", res
        # rounds of new names ran as one collective (not every one: a heartbeat round may come between), and the
        # ranks that submitted other names or layouts missed and negotiated
        assert res["hits"] >= 1 and res["missed"], res["stats"]


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVERAGE])
def test_a_round_of_new_names_packs_flags_digests_and_tensors(op):
    size = 3
    layout = fresh_layout([Meta("allreduce", "<f4", (2, 3), op.value, 0, 0.5, 2.0, False),
                           Meta("allreduce", "<f4", (4,), op.value, 0, 0.5, 2.0, False)])
    assert layout is not None
    rng = np.random.default_rng(5)
    datas = [[rng.standard_normal(m.shape).astype(np.float32) for m in layout] for _ in range(size)]

    def reduce(names_per_rank: list[list[str] | None]) -> tuple[FreshSpec, list[np.ndarray]]:
        specs = [build_fresh(layout, size) for _ in range(size)]
        for r, (spec, names) in enumerate(zip(specs, names_per_rank, strict=True)):
            pack(spec, r, names, datas[r] if names is not None else None)
        total = sum(spec.staging.astype(np.float64) for spec in specs)
        if op is ReduceOp.AVERAGE:
            total /= size
        specs[0].staging[...] = total
        bufs = [np.zeros(m.shape, np.float32) for m in layout]
        if agreed(specs[0]):
            unpack(specs[0], bufs)
            return specs[0], bufs
        return specs[0], []

    _, bufs = reduce([["x", "y"]] * size)
    for k, buf in enumerate(bufs):
        want = reference_reduce([datas[r][k] * np.float32(0.5) for r in range(size)], op) * np.float32(2.0)
        np.testing.assert_allclose(buf, want, rtol=1e-5, atol=1e-6)
    assert reduce([["x", "y"], ["x", "z"], ["x", "y"]])[1] == []  # one rank's names differ
    assert reduce([["x", "y"], None, ["x", "y"]])[1] == []  # one rank submitted something else
    assert reduce([["y", "x"], ["y", "x"], ["x", "y"]])[1] == []  # the order is part of the names


def test_only_small_float_allreduces_of_one_kind_are_packed():
    f4 = Meta("allreduce", "<f4", (4,), "sum", 0, 1.0, 1.0, False)
    assert fresh_layout([f4, f4._replace(shape=(2, 2))]) is not None
    assert fresh_layout([]) is None
    assert fresh_layout([f4._replace(dtype="<i4")]) is None  # integers: the digests' float slots need a float
    assert fresh_layout([f4._replace(dtype="<f2")]) is None  # float16 cannot hold the digests exactly
    assert fresh_layout([f4._replace(op="max")]) is None
    assert fresh_layout([f4, f4._replace(dtype="<f8")]) is None  # two dtypes: two collectives
    assert fresh_layout([f4._replace(kind="broadcast")]) is None
    assert fresh_layout([f4._replace(device="cuda")]) is None
    assert fresh_layout([f4._replace(shape=(1 << 20,))]) is None  # too large to pack
