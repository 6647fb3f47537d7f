"""spark_hvd.runner.fresh: a function run in a fresh Python process, and a whole rank run in one (its collectives
on a new ring of the same job, checked against numpy)."""

from __future__ import annotations

import os
import sys

import cloudpickle
import numpy as np
import pytest

from spark_hvd.runner import run
from spark_hvd.runner.fresh import FreshProcess, run_rank_fresh

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _where(name: str) -> tuple[int, str | None, bool]:
    return os.getpid(), os.environ.get(name), "_pytest" in sys.modules


def _fails() -> None:
    raise KeyError("inner")


def _asks(x: int) -> int:
    from spark_hvd.runner.fresh import ask

    return ask("double", x) + 1


def test_fresh_process_calls_env_errors_and_asks():
    with FreshProcess(env={"SPARK_HVD_TEST_FRESH": "yes"}) as proc:
        pid, value, imported = proc.call(_where, "SPARK_HVD_TEST_FRESH")
        assert pid == proc.pid != os.getpid() and value == "yes"
        assert not imported  # a fresh interpreter: pytest (imported here) is not there
        with pytest.raises(KeyError, match="inner") as info:
            proc.call(_fails)
        assert any("fresh Python process" in note for note in getattr(info.value, "__notes__", []))
        assert proc.call(_asks, 20, on_ask=lambda name, x: 2 * x if name == "double" else None) == 41
        assert proc.call(_where, "SPARK_HVD_TEST_FRESH")[0] == proc.pid  # the same child serves every call


def _inner(seed: int) -> dict:
    import spark_hvd.core as core
    from spark_hvd.core.backend import ReduceOp

    data = np.random.default_rng(seed + core.rank()).standard_normal(1000)
    summed = data.copy()
    core.allreduce(summed, op=ReduceOp.SUM)
    return {"rank": core.rank(), "size": core.size(), "pid": os.getpid(), "data": data, "sum": summed,
            "env": os.environ.get("SPARK_HVD_TEST_FRESH")}


def _outer(seed: int) -> dict:
    out = run_rank_fresh(_inner, (seed,), env={"SPARK_HVD_TEST_FRESH": "child"})
    out["parent"] = os.getpid()
    return out


@pytest.mark.spark
def test_a_rank_in_a_fresh_process_joins_a_new_ring(spark):
    results = run(_outer, args=(7,), num_proc=2)
    assert [r["rank"] for r in results] == [0, 1] and all(r["size"] == 2 for r in results)
    assert all(r["pid"] != r["parent"] and r["env"] == "child" for r in results)
    expected = results[0]["data"] + results[1]["data"]
    for r in results:
        np.testing.assert_allclose(r["sum"], expected, rtol=1e-12)


def _inner_elastic(directory: str) -> dict:
    """In the fresh child of each rank, under run_elastic: the driver link is there (relayed through the parent);
    the first attempt's rank 0 commits 3 bytes through it, then rank 1's child dies; the relaunch reads them back."""
    import spark_hvd.core as core
    from spark_hvd.core.elastic import get_link

    link = get_link()
    assert link is not None, "no driver link in the fresh process"
    marker = os.path.join(directory, "died")
    if not os.path.exists(marker):  # the first attempt
        if core.rank() == 0:
            link.put("c1", 0, b"abc")
            link.commit("c1", [3])
        core.barrier()
        if core.rank() == 1:
            open(marker, "w").close()
            os._exit(17)
        core.barrier()  # fails on rank 0: its peer is gone
    return {"rank": core.rank(), "size": core.size(), "committed": link.committed(),
            "bytes": link.get(0, 3), "grow": link.hosts_updated()}


def _outer_elastic(directory: str) -> dict:
    return run_rank_fresh(_inner_elastic, (directory,))


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_fresh_rank_under_run_elastic_has_the_driver_link_and_its_death_is_a_lost_rank(spark, tmp_path):
    from spark_hvd.runner import run_elastic

    results = run_elastic(_outer_elastic, args=(str(tmp_path),), num_proc=2, min_num_proc=1, max_num_proc=2,
                          reset_limit=2, verbose=0)
    assert (tmp_path / "died").exists()
    assert [r["rank"] for r in results] == list(range(len(results))) and results[0]["size"] == len(results)
    for r in results:  # the relaunch found the first attempt's commit through the relayed link
        assert r["committed"] == [3] and r["bytes"] == b"abc" and r["grow"] in (False, True)
