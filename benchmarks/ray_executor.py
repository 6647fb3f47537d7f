"""One allreduce loop on two workers, launched three ways: ``RayExecutor`` on a local Ray cluster, spark_hvd's
Spark ``run()`` on ``local[2]``, and (where Ray Train is installed) ``ray.train.torch.TorchTrainer`` with
``torch.distributed`` on gloo. Interleaved rounds; for each, the medians of:

- ``start`` (RayExecutor only): ``RayExecutor.start()``, the actors placed and the ring joined;
- ``call``: one launch of the loop, wall time seen by the driver (RayExecutor: ``run(fn)`` on the started workers;
  ``run()``: Spark tasks started, ring joined, loop, ring left; TorchTrainer: ``fit()``, its worker group started
  and stopped each time, as Ray Train does);
- ``loop``: rank 0's own time for the loop inside the call (``--steps`` allreduces of ``--mib`` MiB float32), so
  that ``call - loop`` is the launch's overhead.

    python benchmarks/ray_executor.py --rounds 3 --steps 50 --mib 1

Ray runs with 4 CPUs, no dashboard, on loopback, as ``tests/ray`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))


def hvd_loop(steps: int, mib: float) -> dict[str, float]:
    """``steps`` spark_hvd.torch allreduces of ``mib`` MiB; this rank's seconds for them."""
    import torch

    import spark_hvd.torch as hvd

    hvd.init()
    t = torch.ones(int(mib * 2**18))
    hvd.allreduce(t, name="warm")
    start = time.perf_counter()
    for i in range(steps):
        t = hvd.allreduce(t, name=f"x{i % 4}")
    return {"rank": hvd.rank(), "loop": time.perf_counter() - start, "value": float(t[0])}


def gloo_loop(config: dict[str, Any]) -> None:
    """The same loop with ``torch.distributed.all_reduce`` (Ray Train's process group, gloo), averaging as
    spark_hvd's allreduce does; rank 0 writes its seconds to ``config["out"]`` (Ray Train 2.60's ``Result.metrics``
    keeps only what was reported with a checkpoint)."""
    import torch
    import torch.distributed as dist

    t = torch.ones(int(config["mib"] * 2**18))
    dist.all_reduce(t)
    t /= dist.get_world_size()
    start = time.perf_counter()
    for _ in range(config["steps"]):
        dist.all_reduce(t)
        t /= dist.get_world_size()
    if dist.get_rank() == 0:
        with open(config["out"], "w") as f:
            json.dump({"loop": time.perf_counter() - start, "value": float(t[0])}, f)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--mib", type=float, default=1.0)
    parser.add_argument("--no-spark", action="store_true", help="leave out spark_hvd's Spark run()")
    args = parser.parse_args()

    import ray

    from spark_hvd.ray import RayExecutor

    temp_dir = tempfile.mkdtemp(prefix="shvd-ray-bench-")
    ray.init(num_cpus=4, num_gpus=0, object_store_memory=80 * 1024**2, include_dashboard=False,
             _node_ip_address="127.0.0.1", _temp_dir=temp_dir, log_to_driver=False, configure_logging=False)
    try:
        import ray.train.torch as ray_torch
        from ray.train import RunConfig, ScalingConfig
    except ImportError:
        ray_torch = None
    spark = None
    if not args.no_spark:
        from pyspark.sql import SparkSession

        spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
                 .config("spark.task.maxFailures", "1").getOrCreate())
        from spark_hvd.runner import run as spark_run

    res: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        res.setdefault(key, []).append(value)

    try:
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=120), num_workers=2, cpus_per_worker=1)
        t_start, _ = timed(executor.start)
        add("ray_executor.start", t_start)
        executor.run(hvd_loop, args=[2, args.mib])  # warm: the function's imports in the actors
        if spark is not None:
            spark_run(hvd_loop, args=(2, args.mib), num_proc=2, verbose=0)  # warm Spark's Python workers
        for _ in range(args.rounds):
            t, out = timed(lambda: executor.run(hvd_loop, args=[args.steps, args.mib]))
            add("ray_executor.call", t)
            add("ray_executor.loop", out[0]["loop"])
            if spark is not None:
                t, out = timed(lambda: spark_run(hvd_loop, args=(args.steps, args.mib), num_proc=2, verbose=0))
                add("spark_run.call", t)
                add("spark_run.loop", out[0]["loop"])
            if ray_torch is not None:
                out = os.path.join(temp_dir, "gloo_loop.json")
                config = {"steps": args.steps, "mib": args.mib, "out": out}
                trainer = ray_torch.TorchTrainer(gloo_loop, train_loop_config=config,
                                                 scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                                                 torch_config=ray_torch.TorchConfig(backend="gloo"),
                                                 run_config=RunConfig(storage_path=temp_dir))
                t, _ = timed(trainer.fit)
                add("torch_trainer.call", t)
                with open(out) as f:
                    add("torch_trainer.loop", json.load(f)["loop"])
        t_stop, _ = timed(executor.shutdown)
        add("ray_executor.shutdown", t_stop)
    finally:
        if spark is not None:
            spark.stop()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    summary = {k: round(statistics.median(v), 4) for k, v in res.items()}
    print(json.dumps({"steps": args.steps, "mib": args.mib, "rounds": args.rounds, "median_s": summary,
                      "all_s": {k: [round(x, 4) for x in v] for k, v in res.items()}}, indent=1), file=sys.stdout)


if __name__ == "__main__":
    main()
