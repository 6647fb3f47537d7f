"""The converter's torch loader against petastorm's ``make_spark_converter(df).make_torch_dataloader()``, rows/s.

Issue 44's target: spark_hvd's ``make_converter(df, store).make_torch_dataloader()`` reads >= 1.0x the rows/s of
petastorm's on the same DataFrame, where petastorm installs (it needs pyarrow < 15, so it runs in its own venv:
see tests/data/fixtures/make_petastorm_fixture.py for how that venv is made).

    PYTHONPATH=. python benchmarks/converter.py [--rows 200000] [--width 32] [--batch-size 256] [--rounds 2]
        [--petastorm-python /tmp/petavenv/bin/python] [--json out.json]

One invocation, interleaved: each round runs one child process per side (petastorm's in its venv, spark_hvd's in
this interpreter), petastorm first, then spark_hvd; a child makes the same DataFrame (``spark.range`` with a
``features`` array<float> of ``--width`` values and a double ``label``, from seeded ``rand``), prepares it with its
converter (timed apart), imports torch (untimed: a cost of the process, which petastorm's converter pays while it
prepares), then reads it ``--passes`` times, one epoch each, one process, counting rows and touching
every tensor; it prints its rows/s. The ratio is spark_hvd's median over petastorm's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


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
            for batch in loader:
                n += int(batch["label"].shape[0])
                float(batch["features"][0, 0])  # touch the tensor
        rates.append(n / (time.perf_counter() - t0))
        assert n >= rows, (side, n, rows)
    conv.delete()
    spark.stop()
    return {"side": side, "rows": rows, "prepare_s": round(prepare_s, 2), "rows_per_s": [round(r) for r in rates]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--petastorm-python", default="/tmp/petavenv/bin/python")
    ap.add_argument("--json")
    ap.add_argument("--child", choices=["petastorm", "spark_hvd"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        with tempfile.TemporaryDirectory(prefix="spark_hvd_conv_") as tmp:
            print(json.dumps(child(args.child, args.rows, args.width, args.batch_size, args.passes, tmp)))
        return
    sides = [("spark_hvd", sys.executable)]
    if os.path.exists(args.petastorm_python):
        sides.insert(0, ("petastorm", args.petastorm_python))
    else:
        print(f"no petastorm interpreter at {args.petastorm_python}: spark_hvd only", file=sys.stderr)
    here = os.path.dirname(os.path.abspath(__file__))
    results: dict[str, list[dict]] = {s: [] for s, _ in sides}
    for _ in range(args.rounds):
        for side, python in sides:
            env = dict(os.environ, PYSPARK_PYTHON=python, PYSPARK_DRIVER_PYTHON=python, OMP_NUM_THREADS="1")
            if side == "petastorm":
                env.pop("PYTHONPATH", None)  # its own packages only
            cmd = [python, os.path.join(here, "converter.py"), "--child", side, "--rows", str(args.rows),
                   "--width", str(args.width), "--batch-size", str(args.batch_size), "--passes", str(args.passes)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
            if out.returncode:
                raise SystemExit(f"{side} failed:\n{out.stderr[-3000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(json.dumps(r), file=sys.stderr, flush=True)
            results[side].append(r)
    summary: dict = {"rows": args.rows, "width": args.width, "batch_size": args.batch_size, "runs": results,
                     "cpus": os.cpu_count(), "load_1min": os.getloadavg()[0]}
    medians = {s: statistics.median(x for r in rs for x in r["rows_per_s"]) for s, rs in results.items()}
    summary["median_rows_per_s"] = medians
    if "petastorm" in medians:
        summary["ratio_spark_hvd_over_petastorm"] = round(medians["spark_hvd"] / medians["petastorm"], 2)
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
