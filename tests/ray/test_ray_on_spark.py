"""Ray on Spark: ``ray.util.spark.setup_ray_cluster`` on a ``local[2]`` Spark session (a Ray head on the driver, a
Ray worker node in each of two Spark tasks), then ``RayExecutor`` trains across the two Ray-on-Spark worker nodes.

What it takes on one machine with Ray 2.60 (each point was a failure first):

* token authentication: ``RAY_AUTH_MODE=token`` and one ``RAY_AUTH_TOKEN`` in the environment of the driver and
  of Spark's workers (set before the session starts; on a real cluster, the cluster's environment). Without
  ``RAY_AUTH_MODE`` the driver's ``ray start --head`` turns token auth on, but a ``ray start --address`` does not
  send the token: ``InvalidAuthToken``.
* ``ray`` on the Spark workers' ``PATH`` (``start_ray_node`` runs ``shutil.which("ray")``);
* loopback only, on ``LOOPBACK`` = 127.0.0.2, not 127.0.0.1: a worker node's ``ray start`` (which needs
  ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1``, as Ray on Spark sets it, or it refuses to join a cluster) replaces
  ``127.0.0.1`` / ``localhost`` in ``--address`` and ``--node-ip-address`` with the machine's routed address, and
  talks to the head there; any other 127/8 address is kept. ``spark.driver.host`` puts the head on it, the
  ``node_ip_address`` worker option the worker nodes, ``ray.init(_node_ip_address=...)`` the driver.

The driver is this file run as a script in a process of its own (a fresh Spark JVM: the suite's shared session's
workers would not have the token). Cost: ~4 minutes on 2 cores at load ~50 (a JVM, a Ray head that Ray on Spark
gives a fixed 60 s here, two Ray nodes), so it is marked ``raycluster`` (for its time: setup.cfg deselects it) with
the other real-cluster Ray test (``make ray-clusters``), not in ``make test``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.raycluster]

STEPS, PER_RANK = 5, 8
LOOPBACK = "127.0.0.2"


def _where() -> dict:
    import spark_hvd.core as core

    return {"rank": core.rank(), "local_size": core.local_size(), "cross_size": core.cross_size(),
            "ray_on_spark": os.environ.get("RAY_ON_SPARK_START_RAY_PARENT_PID") is not None,
            "iface": os.environ.get("SPARK_HVD_IFACE_ADDR")}


def driver(tmp: str) -> None:
    """Run as a script: Spark, Ray on Spark, ``RayExecutor`` trains; the results in ``tmp/result.json``."""
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.driver.host", LOOPBACK).config("spark.driver.bindAddress", LOOPBACK)
             .getOrCreate())
    import ray
    import test_ray_executor  # the 2-worker training and its batches
    from ray import cloudpickle
    from ray.util.spark import cluster_init, setup_ray_cluster, shutdown_ray_cluster

    from spark_hvd.ray import RayExecutor

    cloudpickle.register_pickle_by_value(test_ray_executor)
    # Ray on Spark sleeps this long (20 s) after starting the head, then gives up if its port is not open yet: too
    # short on a loaded 2-core machine (failed at load 57)
    cluster_init._RAY_HEAD_STARTUP_TIMEOUT = 60
    out: dict = {}
    ray_tmp = tempfile.mkdtemp(prefix="shvd-ros-")  # short: Ray's socket paths under it must fit in 107 bytes
    started = False
    try:
        out["address"] = setup_ray_cluster(
            max_worker_nodes=2, min_worker_nodes=2, num_cpus_head_node=0,
            object_store_memory_worker_node=80 * 1024**2, object_store_memory_head_node=80 * 1024**2,
            head_node_options={"include_dashboard": False}, worker_node_options={"node_ip_address": LOOPBACK},
            ray_temp_root_dir=ray_tmp)
        started = True
        ray.init(_node_ip_address=LOOPBACK, configure_logging=False)  # RAY_ADDRESS: the head
        deadline = time.monotonic() + 120
        while ray.cluster_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        out["nodes"] = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=120), num_workers=2, cpus_per_worker=1)
        executor.start()
        try:
            out["where"] = executor.run(_where)
            trained = executor.run(test_ray_executor._train, kwargs={"steps": STEPS, "per_rank": PER_RANK})
            out["trained"] = [{k: v.tolist() for k, v in t.items()} for t in trained]
        finally:
            executor.shutdown()
        ray.shutdown()
    finally:
        if started:
            shutdown_ray_cluster()
        spark.stop()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    with open(os.path.join(tmp, "result.json"), "w") as f:
        json.dump(out, f)


def test_ray_executor_trains_on_a_ray_cluster_started_on_spark(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("ray", reason="ray is not installed (pip install 'spark_hvd[ray]')")
    pytest.importorskip("pyspark")
    from test_ray_executor import _one_process

    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", SPARK_LOCAL_IP=LOOPBACK,
               PYTHONPATH=os.pathsep.join([root, str(Path(__file__).parent)]),
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
               PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable, OMP_NUM_THREADS="1")
    env.pop("RAY_ADDRESS", None)
    with open(tmp_path / "driver.log", "w") as log:
        proc = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env, stdout=log,
                              stderr=subprocess.STDOUT, timeout=600)
    assert proc.returncode == 0, (tmp_path / "driver.log").read_text()[-6000:]
    got = json.loads((tmp_path / "result.json").read_text())
    assert got["address"][0].startswith(f"{LOOPBACK}:")
    assert got["nodes"] == [LOOPBACK] * 3  # the head and two worker nodes, all on loopback
    assert [w["rank"] for w in got["where"]] == [0, 1]
    assert all(w["ray_on_spark"] and w["iface"] == LOOPBACK for w in got["where"])
    assert [(w["local_size"], w["cross_size"]) for w in got["where"]] == [(1, 2), (1, 2)]  # two Ray nodes

    want = _one_process(STEPS, PER_RANK)
    for rank, trained in enumerate(got["trained"]):
        for name, value in want.items():
            np.testing.assert_allclose(np.array(trained[name]), value, rtol=1e-5, atol=1e-6,
                                       err_msg=f"rank {rank} {name}")


if __name__ == "__main__":
    driver(sys.argv[1])
