"""run() on ``local-cluster[2,1,1024]``: two executor JVMs, so the two ranks live in different executors.

The cluster also schedules fake GPUs: each worker runs a discovery script that claims a GPU address of its own
(``mkdir`` is atomic, so two workers never claim the same one), executors and tasks ask for one GPU each, and each
rank must see the address Spark gave its task in its ``JobEnv``, and each task of a ``TorchModel.transform`` with
``use_gpu=True`` must choose it (``inference_device()``). No CUDA is needed: nothing touches the device.

A second SparkContext cannot live beside the session fixture, so the run happens in a subprocess, once for the
module (~30-60 s): the tests read its result.
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

    def transform_devices():
        # TorchModel.transform with use_gpu on the same executors: each task's module reports inference_device()
        import torch
        from spark_hvd.estimators import TorchModel

        class Probe(torch.nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.lin = torch.nn.Linear(3, 1)

            def forward(self, x):
                from spark_hvd.estimators.common.model import inference_device
                d = inference_device()  # None on the driver, which takes the output shapes
                visible = os.environ.get("CUDA_VISIBLE_DEVICES") if d is not None else None
                want = -2.0 if d is None or d.address is None else (
                    float(visible.split(",").index(d.address)) if visible else float(d.address))
                code = [-2.0] * 3 if d is None else [-1.0 if d.address is None else float(d.address),
                                                     -1.0 if d.ordinal is None else float(d.ordinal), want]
                return torch.cat([self.lin(x), torch.tensor(code).expand(len(x), 3)], dim=1)

        x = np.random.default_rng(5).standard_normal((64, 3)).astype(np.float32)
        df = spark.createDataFrame([(i, x[i].tolist()) for i in range(64)], "id long, arr array<float>")
        model = TorchModel(model=Probe(), feature_cols=["arr"], label_cols=["t"], batch_size=16, use_gpu=True)
        rows = sorted(model.transform(df.repartition(4)).collect(), key=lambda r: r.id)
        with torch.no_grad():
            expect = model.getModel().lin(torch.from_numpy(x)).numpy()[:, 0]
        return {"out": [list(r.t__output) for r in rows], "expect": expect.tolist()}

    try:
        results = run(fn, args=(99,), num_proc=2, start_timeout=400)
        print("RESULT:" + json.dumps(results), flush=True)
        print("TRANSFORM:" + json.dumps(transform_devices()), flush=True)
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
    results = json.loads(line[len("RESULT:"):])
    line = next(line for line in proc.stdout.splitlines() if line.startswith("TRANSFORM:"))
    return {"ranks": results, "transform": json.loads(line[len("TRANSFORM:"):])}


@pytest.mark.timeout(660)
def test_allreduce_across_two_executor_jvms(cluster_results):
    results = cluster_results["ranks"]
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
    for r in cluster_results["ranks"]:
        assert len(r["spark_gpu"]) == 1, r
        assert r["job_gpu"] == r["env_gpu"] == str(r["local_rank"]) == r["env_local_rank"], r
        assert r["cuda_visible"].split(",")[int(r["job_gpu"])] == r["spark_gpu"][0], r
    assert sorted(r["spark_gpu"][0] for r in cluster_results["ranks"]) == ["0", "1"]
    assert len({r["cuda_visible"] for r in cluster_results["ranks"]}) == 1


@pytest.mark.timeout(660)
def test_transform_with_use_gpu_takes_each_task_gpu(cluster_results):
    # TorchModel.transform(use_gpu=True) on the same executors: each task's module read inference_device(); the
    # address is the GPU Spark gave that executor's task, its CUDA ordinal the address's place in the worker's
    # CUDA_VISIBLE_DEVICES (or the address); no CUDA here, so the values are the CPU's, equal to the module's
    out = np.asarray(cluster_results["transform"]["out"])
    np.testing.assert_allclose(out[:, 0], cluster_results["transform"]["expect"], rtol=1e-5, atol=1e-6)
    assert set(out[:, 1]) <= {0.0, 1.0}, np.unique(out[:, 1:], axis=0)
    np.testing.assert_array_equal(out[:, 2], out[:, 3])
