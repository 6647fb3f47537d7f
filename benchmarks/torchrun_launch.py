"""The same DDP script (``ddp_script.py``) launched by spark_hvd's ``run()`` and by pyspark's ``TorchDistributor``
on the same ``local[2]`` session, two processes each, interleaved: seconds from the call to the end of the first
step, steady steps/s (rank 0's), and the call's wall time.

    python benchmarks/torchrun_launch.py --rounds 3

TorchDistributor runs with ``local_mode=False`` (one torchrun per Spark task, as on a cluster) and ``use_gpu=False``.
Spark's Python workers are warmed by one untimed call of each first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "ddp_script.py")


def _spark_hvd(args: list[str]) -> None:
    from spark_hvd.runner import run

    run(SCRIPT, args=args, num_proc=2, verbose=0)


def _distributor(args: list[str]) -> None:
    from pyspark.ml.torch.distributor import TorchDistributor

    TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(SCRIPT, *args)


def _one(launch, steps: int, out_dir: str) -> dict:
    out = os.path.join(out_dir, "out.json")
    t0 = time.time()
    launch(["--t0", repr(t0), "--out", out, "--steps", str(steps)])
    wall = time.time() - t0
    with open(out) as f:
        result = json.load(f)
    os.remove(out)
    return {**result, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=80)
    opts = parser.parse_args()
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.python.worker.reuse", "true").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    launchers = {"spark_hvd run()": _spark_hvd, "TorchDistributor": _distributor}
    rows: dict[str, list[dict]] = {name: [] for name in launchers}
    with tempfile.TemporaryDirectory() as tmp:
        for launch in launchers.values():  # warm the Python workers (imports) for both
            _one(launch, 12, tmp)
        for r in range(opts.rounds):
            order = list(launchers.items()) if r % 2 == 0 else list(reversed(launchers.items()))
            for name, launch in order:
                rows[name].append(_one(launch, opts.steps, tmp))
                print(f"round {r} {name}: {rows[name][-1]}", file=sys.stderr)
    med = {name: {k: statistics.median(x[k] for x in rs) for k in ("first_step_s", "steps_per_s", "wall_s")}
           for name, rs in rows.items()}
    print("| launcher | first step (s) | steps/s | call wall (s) |")
    print("| --- | --- | --- | --- |")
    for name, m in med.items():
        print(f"| {name} | {m['first_step_s']:.2f} | {m['steps_per_s']:.1f} | {m['wall_s']:.2f} |")
    a, b = med["spark_hvd run()"], med["TorchDistributor"]
    print(f"\nspark_hvd / TorchDistributor: first step {a['first_step_s'] / b['first_step_s']:.2f}x, "
          f"steps/s {a['steps_per_s'] / b['steps_per_s']:.2f}x (medians of {opts.rounds} interleaved rounds)")
    spark.stop()


if __name__ == "__main__":
    main()
