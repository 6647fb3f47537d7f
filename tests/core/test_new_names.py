"""Rounds of tensors the ranks have not negotiated before (new names, unnamed calls): when every rank submits the
same, no rank's message travels (the fast round's digests agree), and every result still matches numpy; ranks
that submit in different orders, or differently, still meet or fail as before, naming the tensor and the rank."""

from __future__ import annotations

import helpers.engine_scenarios as sc
import numpy as np
import pytest
from helpers.ranks import run_ranks

import spark_hvd.core as core
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
        # 4. a new name with another shape on the last rank: a mismatch naming it on every rank, then in step
        shape = (5,) if r == n - 1 else (4,)
        error = ""
        try:
            core.allreduce(np.ones(shape, np.float32), name="odd", op=ReduceOp.SUM)
        except TensorMismatchError as exc:
            error = f"{exc.name} {exc.ranks}"
        _round(seed + 300, ["after.a", "after.b", "after.c"], [0, 1, 2])
        return {"agreed": agreed, "travelled": travelled, "error": error, "stats": dict(engine.stats)}
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
