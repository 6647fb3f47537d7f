"""Rows per second of spark_hvd's BatchReader against a plain pyarrow.dataset scan of the same Parquet files.

The table: ``--rows`` rows (default 2 million) of 10 scalar columns (float64, float32, int64, int32, bool) and one
784-float32 list column (MNIST-like values k/255, dictionary-encoded by Parquet as Spark would write them).
Variants, interleaved and repeated (best of ``--repeats``), each with the jemalloc and the mimalloc pool:

- ``scan``: ``dataset.to_batches()`` over all columns, counting rows (Arrow batches, no numpy);
- ``reader``: ``BatchReader(shuffle=False)``: numpy batches (the list column reshaped to (batch, 784));
- ``reader+shuffle``: ``BatchReader(shuffle=True)``: row groups shuffled, rows mixed in a 65536-row buffer.

Run:  .venv/bin/python benchmarks/reader.py [--rows 2000000] [--repeats 3] [--dir /tmp/reader-bench] [--json out]
The files are written once and reused by later runs with the same ``--rows`` (delete ``--dir`` to rebuild).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spark_hvd.data.reader import BatchReader, resolve_memory_pool  # noqa: E402

logger = logging.getLogger("bench.reader")
WIDTH = 784


def build(path: str, rows: int, files: int = 8, row_group_rows: int = 50_000, seed: int = 0) -> None:
    """Write the benchmark table under ``path`` unless a complete copy with ``rows`` rows is there."""
    stamp = os.path.join(path, "_rows")
    if os.path.exists(stamp) and open(stamp).read().strip() == str(rows):
        return
    os.makedirs(path, exist_ok=True)
    for f in os.listdir(path):
        os.remove(os.path.join(path, f))
    rng = np.random.default_rng(seed)
    bounds = np.linspace(0, rows, files + 1).astype(np.int64)
    for i in range(files):
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        writer = None
        for start in range(lo, hi, row_group_rows):
            n = min(row_group_rows, hi - start)
            flat = (rng.integers(0, 256, n * WIDTH, dtype=np.uint8).astype(np.float32)) / np.float32(255)
            cols = {
                "id": pa.array(np.arange(start, start + n, dtype=np.int64)),
                "label": pa.array(rng.integers(0, 10, n).astype(np.int32)),
                "weight": pa.array(rng.random(n)),
                "f0": pa.array(rng.standard_normal(n)),
                "f1": pa.array(rng.standard_normal(n)),
                "f2": pa.array(rng.standard_normal(n).astype(np.float32)),
                "f3": pa.array(rng.standard_normal(n).astype(np.float32)),
                "i0": pa.array(rng.integers(0, 1000, n)),
                "i1": pa.array(rng.integers(0, 1000, n).astype(np.int32)),
                "flag": pa.array(rng.random(n) < 0.5),
                "features": pa.ListArray.from_arrays(
                    pa.array(np.arange(0, (n + 1) * WIDTH, WIDTH, dtype=np.int32)), pa.array(flat)
                ),
            }
            table = pa.table(cols)
            if writer is None:
                writer = pq.ParquetWriter(os.path.join(path, f"part-{i:05d}.parquet"), table.schema)
            writer.write_table(table, row_group_size=row_group_rows)
        if writer is not None:
            writer.close()
    with open(stamp, "w") as f:
        f.write(str(rows))


def run_scan(path: str, pool: str, batch_size: int) -> int:
    dataset = ds.dataset(path, format="parquet")
    n = 0
    for b in dataset.to_batches(memory_pool=resolve_memory_pool(pool)):
        n += b.num_rows
    return n


def run_reader(path: str, pool: str, batch_size: int, shuffle: bool) -> int:
    reader = BatchReader(path, batch_size=batch_size, shuffle=shuffle, seed=1, memory_pool=pool, shapes={})
    n = 0
    for b in reader.epoch(0):
        assert b["features"].shape[1:] == (WIDTH,)
        n += len(b["id"])
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--dir", default="/tmp/spark_hvd-reader-bench")
    ap.add_argument("--pools", default="jemalloc,mimalloc")
    ap.add_argument("--json", default=None, help="write the measurements here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    t0 = time.perf_counter()
    build(args.dir, args.rows)
    size = sum(os.path.getsize(os.path.join(args.dir, f)) for f in os.listdir(args.dir))
    logger.info("data: %d rows, %.2f GB on disk, ready in %.0f s", args.rows, size / 1e9, time.perf_counter() - t0)
    pools = args.pools.split(",")
    variants = {}
    for pool in pools:
        variants[("scan", pool)] = lambda pool=pool: run_scan(args.dir, pool, args.batch_size)
        variants[("reader", pool)] = lambda pool=pool: run_reader(args.dir, pool, args.batch_size, False)
        variants[("reader+shuffle", pool)] = lambda pool=pool: run_reader(args.dir, pool, args.batch_size, True)
    best: dict[tuple[str, str], float] = {}
    best_cpu: dict[tuple[str, str], float] = {}
    times: dict[str, list[float]] = {f"{k[0]}/{k[1]}": [] for k in variants}
    cpu_times: dict[str, list[float]] = {f"{k[0]}/{k[1]}": [] for k in variants}
    run_scan(args.dir, pools[0], args.batch_size)  # warm the page cache
    for rep in range(args.repeats):
        for key, fn in variants.items():
            t, c = time.perf_counter(), time.process_time()
            n = fn()
            dt, dc = time.perf_counter() - t, time.process_time() - c
            if n < args.rows:
                raise RuntimeError(f"{key} read {n} rows of {args.rows}")
            times[f"{key[0]}/{key[1]}"].append(dt)
            cpu_times[f"{key[0]}/{key[1]}"].append(dc)
            best[key] = min(best.get(key, float("inf")), dt)
            best_cpu[key] = min(best_cpu.get(key, float("inf")), dc)
            logger.info(
                "rep %d %-16s %-9s %6.2f s wall %6.2f s cpu %9.0f rows/s", rep, key[0], key[1], dt, dc, args.rows / dt
            )

    lines = [
        f"| variant | pool | best wall s | rows/s | vs scan ({pools[0]}) | vs scan (same pool) "
        f"| least CPU s | CPU vs scan ({pools[0]}) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    ref = best[("scan", pools[0])]
    ref_cpu = best_cpu[("scan", pools[0])]
    for (name, pool), dt in best.items():
        lines.append(
            f"| {name} | {pool} | {dt:.2f} | {args.rows / dt:,.0f} | {ref / dt:.2f} | {best[('scan', pool)] / dt:.2f} "
            f"| {best_cpu[(name, pool)]:.2f} | {ref_cpu / best_cpu[(name, pool)]:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"rows": args.rows, "batch_size": args.batch_size, "wall_s": times, "cpu_s": cpu_times, "table": table},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
