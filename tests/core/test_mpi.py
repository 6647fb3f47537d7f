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
    sys.path.insert(0, str(HERE))
    import test_engine_scenarios as sc

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


@pytest.mark.skipif(not MPIRUN.exists() and shutil.which("mpirun") is None, reason="no mpirun")
def test_engine_on_mpi_backend_np2():
    mpirun = str(MPIRUN) if MPIRUN.exists() else shutil.which("mpirun")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               SPARK_HVD_TIMEOUT="60", SPARK_HVD_CYCLE_TIME="5", PYTHONPATH=str(HERE.parent.parent))
    for var in ("SPARK_HVD_RANK", "SPARK_HVD_SIZE", "SPARK_HVD_BACKEND"):
        env.pop(var, None)
    proc = subprocess.run([mpirun, "-np", "2", "--oversubscribe", sys.executable, __file__], env=env,
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, f"mpirun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    reports = [json.loads(line.split("REPORT ", 1)[1]) for line in proc.stdout.splitlines() if "REPORT " in line]
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
    _rank_main()
