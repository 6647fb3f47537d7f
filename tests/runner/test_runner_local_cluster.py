"""run() on ``local-cluster[2,1,1024]``: two executor JVMs, so the two ranks live in different executors.

The cluster also schedules fake GPUs: each worker runs a discovery script that claims a GPU address of its own
(``mkdir`` is atomic, so two workers never claim the same one), executors and tasks ask for one GPU each, and each
rank must see the address Spark gave its task in its ``JobEnv``. No CUDA is needed: nothing touches the device.

A second SparkContext cannot live beside the session fixture, so the run happens in a subprocess, once for the
module (~30-60 s): both tests read its result.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.spark, pytest.mark.slow]

CANNOT_START = 3

DISCOVERY = textwrap.dedent("""\
    #!/bin/sh
    for i in 0 1 2 3 4 5 6 7; do
      if mkdir "%(claims)s/gpu-$i" 2>/dev/null; then
        echo '{"name": "gpu", "addresses": ["'$i'"]}'
        exit 0
      fi
    done
    exit 1
""")

SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    from pyspark.sql import SparkSession

    try:
        spark = (SparkSession.builder.master("local-cluster[2,1,1024]").appName("spark_hvd-local-cluster")
                 .config("spark.ui.enabled", "false").config("spark.executor.memory", "512m")
                 .config("spark.executor.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
                 .config("spark.worker.resource.gpu.amount", "1")
                 .config("spark.worker.resource.gpu.discoveryScript", %(discovery)r)
                 .config("spark.executor.resource.gpu.amount", "1")
                 .config("spark.task.resource.gpu.amount", "1")
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
        from spark_hvd.core.jobenv import JobEnv
        data = np.random.default_rng(seed + hvd.rank()).standard_normal(257)
        out = data.copy()
        hvd.allreduce(out, op=ReduceOp.SUM)
        task = BarrierTaskContext.get()
        return {"rank": hvd.rank(), "size": hvd.size(), "data": data.tolist(), "sum": out.tolist(),
                "executors": [info.address for info in task.getTaskInfos()], "pid": os.getpid(),
                "spark_gpu": list(task.resources()["gpu"].addresses), "job_gpu": hvd.job_env().gpu,
                "env_gpu": JobEnv.from_env().gpu, "local_rank": hvd.local_rank(),
                "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "env_local_rank": os.environ.get("LOCAL_RANK")}

    try:
        results = run(fn, args=(99,), num_proc=2, start_timeout=400)
        print("RESULT:" + json.dumps(results), flush=True)
    finally:
        spark.stop()
""")


@pytest.fixture(scope="module")
def cluster_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("local_cluster")
    (tmp / "claims").mkdir()
    discovery = tmp / "discover_gpus.sh"
    discovery.write_text(DISCOVERY % {"claims": tmp / "claims"})
    discovery.chmod(discovery.stat().st_mode | stat.S_IXUSR)
    script = tmp / "local_cluster_run.py"
    script.write_text(SCRIPT % {"cannot_start": CANNOT_START, "discovery": str(discovery)})
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
    return json.loads(line[len("RESULT:"):])


@pytest.mark.timeout(660)
def test_allreduce_across_two_executor_jvms(cluster_results):
    results = cluster_results
    assert [r["rank"] for r in results] == [0, 1] and all(r["size"] == 2 for r in results)
    # two different executor JVMs: the barrier tasks' executor addresses differ
    assert len(set(results[0]["executors"])) == 2, results[0]["executors"]
    assert results[0]["pid"] != results[1]["pid"]
    expected = np.asarray(results[0]["data"]) + np.asarray(results[1]["data"])
    for r in results:
        np.testing.assert_allclose(r["sum"], expected, rtol=1e-12)


@pytest.mark.timeout(660)
def test_each_rank_gets_the_gpu_spark_assigned_to_its_task(cluster_results):
    # the host's GPUs become CUDA_VISIBLE_DEVICES in local-rank order (as torchrun users expect), so the rank's
    # device index is its local rank, and that index of the visible list is the GPU Spark gave its task
    for r in cluster_results:
        assert len(r["spark_gpu"]) == 1, r
        assert r["job_gpu"] == r["env_gpu"] == str(r["local_rank"]) == r["env_local_rank"], r
        assert r["cuda_visible"].split(",")[int(r["job_gpu"])] == r["spark_gpu"][0], r
    assert sorted(r["spark_gpu"][0] for r in cluster_results) == ["0", "1"]
    assert len({r["cuda_visible"] for r in cluster_results}) == 1
