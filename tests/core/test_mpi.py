"""The engine on the MPI backend under ``mpirun -np 2`` (this file is also the script each MPI rank runs)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
MPIRUN = Path(sys.executable).parent / "mpirun"


def _rank_main() -> None:
    import helpers.engine_scenarios as sc

    import spark_hvd.core as core

    core.init()
    assert core.backend_name() == "mpi", core.backend_name()
    assert core.size() == int(os.environ["OMPI_COMM_WORLD_SIZE"])
    assert core.rank() == int(os.environ["OMPI_COMM_WORLD_RANK"])
    report = {"rank": core.rank(), "size": core.size(), "local_size": core.local_size()}
    report["checked"] = sc.collectives(seed=11)
    sc.different_orders()
    report["fusion"] = sc.fusion()
    report["mismatch"] = sc.mismatch()
    report["join"] = sc.join_uneven()
    core.shutdown()
    print("REPORT " + json.dumps(report), flush=True)


def _late_rank_main() -> None:
    """Rank 2 is frozen (sleeps, not in spark_hvd) while ranks 0 and 1 allreduce: their timeout names rank 2.
    Rank 2 then joins the collective, so every rank finishes cleanly."""
    import time

    import numpy as np

    from spark_hvd.core.backend import ReduceOp
    from spark_hvd.core.backends.mpi_backend import MpiBackend
    from spark_hvd.core.errors import CollectiveTimeoutError
    from spark_hvd.core.settings import Settings

    backend = MpiBackend(Settings(timeout_s=2.0))
    report: dict = {"rank": backend.rank}
    buf = np.ones(4, np.float32)
    if backend.rank == 2:
        time.sleep(7.0)  # past the others' timeout and their wait for answers
        backend._mpi.COMM_WORLD.Barrier()
    else:
        try:
            backend.allreduce(buf, ReduceOp.SUM)
        except CollectiveTimeoutError as exc:
            report["error"] = str(exc)
            report["late"] = exc.rank
        backend._mpi.COMM_WORLD.Barrier()
    print("REPORT " + json.dumps(report), flush=True)


def _mpirun(np_: int, *args: str, timeout: float = 150) -> list[dict]:
    mpirun = str(MPIRUN) if MPIRUN.exists() else shutil.which("mpirun")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               SPARK_HVD_TIMEOUT="60", SPARK_HVD_CYCLE_TIME="5",
               PYTHONPATH=os.pathsep.join([str(HERE.parent.parent), str(HERE.parent)]))  # the repo, tests/ (helpers)
    for var in ("SPARK_HVD_RANK", "SPARK_HVD_SIZE", "SPARK_HVD_BACKEND"):
        env.pop(var, None)
    proc = subprocess.run([mpirun, "-np", str(np_), "--oversubscribe", sys.executable, __file__, *args], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"mpirun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return [json.loads(line.split("REPORT ", 1)[1]) for line in proc.stdout.splitlines() if "REPORT " in line]


needs_mpirun = pytest.mark.skipif(not MPIRUN.exists() and shutil.which("mpirun") is None, reason="no mpirun")


@needs_mpirun
def test_mpi_timeout_names_the_late_rank():
    reports = sorted(_mpirun(3, "late"), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1, 2]
    for report in reports[:2]:
        assert report["late"] == 2, report
        detail = report["error"].split("(SPARK_HVD_TIMEOUT): ", 1)[1]
        assert detail.startswith("rank 2 did not answer"), report  # and names no other rank
        assert "rank 0" not in detail and "rank 1" not in detail, report


@needs_mpirun
def test_engine_on_mpi_backend_np2():
    reports = _mpirun(2)
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for report in reports:
        assert report["size"] == 2 and report["local_size"] == 2
        assert report["checked"] > 20
        fusion = report["fusion"]
        assert fusion["allreduce_tensors"] == 100
        assert fusion["allreduce_collectives"] <= 25, fusion
        assert len(report["mismatch"]) == 3
        assert report["join"] == 1


if __name__ == "__main__":
    _late_rank_main() if sys.argv[1:] == ["late"] else _rank_main()
