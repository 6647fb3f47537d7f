"""The converter's torch loader against petastorm's ``make_spark_converter(df).make_torch_dataloader()``, rows/s.

Issue 44's target: spark_hvd's ``make_converter(df, store).make_torch_dataloader()`` reads >= 1.0x the rows/s of
petastorm's on the same DataFrame, where petastorm installs. Petastorm 0.13.1 needs pyarrow < 15, so both sides run
in one venv with the floor leg's packages (runtimes/dbr-15.4-ml.txt: pyarrow 14, pyspark 3.5.0, pandas 1.5.3,
torch) plus petastorm, and spark_hvd from this checkout on ``PYTHONPATH`` (no install)::

    python -m venv .venv-peta   # from the floor leg's interpreter, its site-packages put on the path by a .pth file
    .venv-peta/bin/pip install -c <the leg's pins but setuptools> petastorm==0.13.1   # petastorm wants setuptools<70
    PYTHONPATH=. .venv-peta/bin/python benchmarks/converter.py [--rows 200000] [--width 32] [--batch-size 256]
        [--rounds 2] [--passes 3] [--python .venv-peta/bin/python] [--json out.json]

One invocation, interleaved: each round runs one child process per side with the same interpreter (``--python``,
default this one), petastorm first, then spark_hvd; a child makes the same DataFrame (``spark.range`` with a
``features`` array<float> of ``--width`` values and a double ``label``, from seeded ``rand``), prepares it with its
converter (timed apart), imports torch (untimed: a cost of the process, which petastorm's converter pays while it
prepares), then reads it ``--passes`` times, one epoch each, one process, counting rows and touching
every tensor; it prints its rows/s. The ratio is spark_hvd's median over petastorm's.

Petastorm 0.13.1's thread pool can end an epoch before it starts: ``ThreadPool.get_results`` checks that every
worker is done and then that the ventilator has completed, not atomically, so when its ventilation thread hands out
the whole epoch between the two checks the loader yields 0 rows (seen here in 1 of 12 loaders, and in earlier runs
of this script). The petastorm child therefore waits (up to 30 s, inside the timed pass) until the first row group
is handed out before iterating; a pass that still reads fewer rows than the DataFrame has stops the script.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from _timing import finish, interleaved


def _frame(spark, rows: int, width: int):
    from pyspark.sql import functions as F

    feats = F.array(*[F.rand(100 + i).cast("float") for i in range(width)])
    return spark.range(rows).repartition(8).select(feats.alias("features"), F.rand(7).alias("label"))


def child(side: str, rows: int, width: int, batch_size: int, passes: int, workdir: str) -> dict:
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.driver.memory", "2g").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    df = _frame(spark, rows, width)
    t0 = time.perf_counter()
    if side == "petastorm":
        from petastorm.spark import SparkDatasetConverter, make_spark_converter

        spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, "file://" + os.path.join(workdir, "cache"))
        conv = make_spark_converter(df)
    else:
        from spark_hvd.data import make_converter
        from spark_hvd.store import Store

        conv = make_converter(df, Store.create(os.path.join(workdir, "store")), num_proc=1)
    prepare_s = time.perf_counter() - t0
    import torch  # noqa: F401 - a one-time cost of the process, not the loader's: petastorm's converter had it already

    rates = []
    for _ in range(passes):
        n, t0 = 0, time.perf_counter()
        if side == "petastorm":
            ctx = conv.make_torch_dataloader(batch_size=batch_size, num_epochs=1)
        else:
            ctx = conv.make_torch_dataloader(batch_size=batch_size, num_epochs=1, cur_shard=0, shard_count=1)
        with ctx as loader:
            if side == "petastorm":
                _ventilation_started(loader)
            for batch in loader:
                n += int(batch["label"].shape[0])
                float(batch["features"][0, 0])  # touch the tensor
        rates.append(n / (time.perf_counter() - t0))
        assert n >= rows, (side, n, rows)
    conv.delete()
    spark.stop()
    return {"side": side, "rows": rows, "prepare_s": round(prepare_s, 2), "rows_per_s": [round(r) for r in rates]}


def _ventilation_started(loader, timeout_s: float = 30.0) -> None:
    """Wait until petastorm's reader has handed out its first row group (see the module docstring)."""
    pool = loader.reader._workers_pool
    deadline = time.monotonic() + timeout_s
    while getattr(pool, "_ventilated_items", 1) == 0:
        if time.monotonic() > deadline:
            raise SystemExit(f"petastorm's reader handed out no row group within {timeout_s} s")
        time.sleep(0.001)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--python", default=sys.executable, help="the interpreter of both children (with petastorm)")
    ap.add_argument("--json")
    ap.add_argument("--child", choices=["petastorm", "spark_hvd"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        with tempfile.TemporaryDirectory(prefix="spark_hvd_conv_") as tmp:
            print(json.dumps(child(args.child, args.rows, args.width, args.batch_size, args.passes, tmp)))
        return
    here = os.path.dirname(os.path.abspath(__file__))
    check = subprocess.run([args.python, "-c", "import petastorm"], capture_output=True)
    sides = ["petastorm", "spark_hvd"] if check.returncode == 0 else ["spark_hvd"]
    if check.returncode:
        print(f"petastorm does not import in {args.python}: spark_hvd only", file=sys.stderr)
    env = dict(os.environ, PYSPARK_PYTHON=args.python, PYSPARK_DRIVER_PYTHON=args.python, OMP_NUM_THREADS="1")

    def run_child(side: str) -> dict:
        cmd = [args.python, os.path.join(here, "converter.py"), "--child", side, "--rows", str(args.rows),
               "--width", str(args.width), "--batch-size", str(args.batch_size), "--passes", str(args.passes)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if out.returncode:
            raise SystemExit(f"{side} failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    results, medians = interleaved(args.rounds, sides, run_child, lambda r: r["rows_per_s"])
    summary: dict = {"rows": args.rows, "width": args.width, "batch_size": args.batch_size, "python": args.python,
                     "runs": results, "cpus": os.cpu_count(), "load_1min": os.getloadavg()[0],
                     "median_rows_per_s": medians}
    if "petastorm" in medians:
        summary["ratio_spark_hvd_over_petastorm"] = round(medians["spark_hvd"] / medians["petastorm"], 2)
    finish(summary, args.json)

if __name__ == "__main__":
    main()
