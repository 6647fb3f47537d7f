"""run() on ``local-cluster[2,1,1024]``: two executor JVMs, so the two ranks live in different executors.

A second SparkContext cannot live beside the session fixture, so the run happens in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.spark, pytest.mark.slow]

CANNOT_START = 3

SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    from pyspark.sql import SparkSession

    try:
        spark = (SparkSession.builder.master("local-cluster[2,1,1024]").appName("spark_hvd-local-cluster")
                 .config("spark.ui.enabled", "false").config("spark.executor.memory", "512m")
                 .getOrCreate())
        sc = spark.sparkContext
        deadline = time.monotonic() + 180
        while len(sc._jsc.sc().statusTracker().getExecutorInfos()) < 3 and time.monotonic() < deadline:
            time.sleep(0.5)  # the driver plus two executors
        if len(sc._jsc.sc().statusTracker().getExecutorInfos()) < 3:
            raise RuntimeError("the two executors did not register within 180 s")
    except Exception as exc:
        print("CANNOT_START:", repr(exc), flush=True)
        sys.exit(%(cannot_start)d)

    from spark_hvd.runner import run

    def fn(seed):
        from pyspark import BarrierTaskContext
        import spark_hvd.core as hvd
        from spark_hvd.core.backend import ReduceOp
        data = np.random.default_rng(seed + hvd.rank()).standard_normal(257)
        out = data.copy()
        hvd.allreduce(out, op=ReduceOp.SUM)
        return {"rank": hvd.rank(), "size": hvd.size(), "data": data.tolist(), "sum": out.tolist(),
                "executors": [info.address for info in BarrierTaskContext.get().getTaskInfos()],
                "pid": os.getpid()}

    try:
        results = run(fn, args=(99,), num_proc=2, start_timeout=400)
        print("RESULT:" + json.dumps(results), flush=True)
    finally:
        spark.stop()
""") % {"cannot_start": CANNOT_START}


@pytest.mark.timeout(660)
def test_allreduce_across_two_executor_jvms(tmp_path):
    script = tmp_path / "local_cluster_run.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
               SPARK_LOCAL_IP="127.0.0.1")
    try:
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                              env=env, cwd=Path(__file__).resolve().parents[2])
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"local-cluster run did not finish within 600 s; output tail: {str(exc.stdout)[-2000:]}")
    if proc.returncode == CANNOT_START:
        pytest.skip("local-cluster[2,1,1024] cannot start here: "
                    + next((line for line in proc.stdout.splitlines() if line.startswith("CANNOT_START")), "?"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT:"))
    results = json.loads(line[len("RESULT:"):])
    assert [r["rank"] for r in results] == [0, 1] and all(r["size"] == 2 for r in results)
    # two different executor JVMs: the barrier tasks' executor addresses differ
    assert len(set(results[0]["executors"])) == 2, results[0]["executors"]
    assert results[0]["pid"] != results[1]["pid"]
    expected = np.asarray(results[0]["data"]) + np.asarray(results[1]["data"])
    for r in results:
        np.testing.assert_allclose(r["sum"], expected, rtol=1e-12)
