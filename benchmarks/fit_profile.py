"""Where the time of a ``TorchEstimator.fit`` goes: a first fit (prepares the data) and a warm one, phase by phase.

The driver's phases are timed by wrapping the functions that do them (the checks' Spark job, the preparation's
jobs, the Parquet write, the footers read back, the barrier stage); each Spark job's wall time comes from Spark's
own event log (job start and end, the job's description); the ranks' phases come from a wrapper of the rank
function that times, inside the rank's process, what the rank did before it (the Python worker's start, the
payload's unpickling with its imports, ``spark_hvd.core.init``) and each step of the training run.

    .venv/bin/python benchmarks/fit_profile.py [--fit-rows 50000] [--epochs 3] [--batch 128] [--warm-fits 1]
        [--no-warm-workers] [--out profile.json]

``--no-warm-workers`` leaves Spark's Python workers cold (no torch imported in them before the fit);
by default a ``mapInArrow`` that imports torch runs first, as ``estimator.py``'s transform section does before
its first fit.
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import features_df, finish  # noqa: E402

log = logging.getLogger("benchmarks.fit_profile")

PHASES: list[tuple[str, float, float]] = []
#: modules a rank need not import (the driver's side of the estimators), reported when a rank has them
_HEAVY = ("pyspark.ml", "pandas", "scipy", "torch._dynamo")


def _timed(owner: Any, name: str, label: str, into: list | None = None) -> Any:
    """Wrap ``owner.name`` so that every call is recorded as ``(label, start, end)`` in ``into`` (default PHASES);
    return what was there (to put it back)."""
    fn = getattr(owner, name)
    marks = PHASES if into is None else into

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            marks.append((label, t0, time.time()))

    setattr(owner, name, wrapper)
    return fn


def _proc_start_time() -> float:
    """This process's start, seconds since the epoch (Linux /proc)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
        btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def profiled_rank(trainer_class: Any, spec: Any) -> Any:
    """``train_on_rank`` with the rank's phases timed (returned in rank 0's result under ``"_profile"``)."""
    import sys as _sys
    import time as _time

    entered = _time.time()
    torch_before = "torch" in _sys.modules
    heavy_before = [m for m in _HEAVY if m in _sys.modules]
    from spark_hvd.estimators.common import rank_run

    marks: list[tuple[str, float, float]] = []
    saved = {}
    for owner, name, label in ((trainer_class, "init", "trainer.init"), (trainer_class, "build", "trainer.build"),
                               (rank_run.RankRun, "_resume", "resume check + sync"),
                               (rank_run.ShardReaders, "__init__", "ShardReaders (footers)"),
                               (trainer_class, "train", "train (all epochs)"),
                               (rank_run.RankRun, "end_epoch", "end_epoch"),
                               (rank_run.RankRun, "_finish", "finish (wait upload, shapes, save model)")):
        saved[(owner, name)] = _timed(owner, name, label, into=marks)
    try:
        out = rank_run.train_on_rank(trainer_class, spec)
    finally:
        for (cls, name), fn in saved.items():
            setattr(cls, name, fn)
    prof = {"proc_start": _proc_start_time(), "entered": entered, "left": _time.time(),
            "torch_imported_before_fn": torch_before, "marks": marks, "pid": os.getpid(),
            "heavy_modules": heavy_before + ["at exit:"] + [m for m in _HEAVY if m in _sys.modules]}
    from spark_hvd.runner import report

    report(_profile=json.dumps(prof))
    if out is not None:
        out["_profile"] = prof
    return out


def event_log_jobs(path: str) -> list[dict]:
    """The jobs in a Spark event log: id, description, start and end (seconds), stages and their tasks' launches."""
    jobs: dict[int, dict] = {}
    stage_job: dict[int, int] = {}
    for line in open(path, errors="replace"):
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        kind = ev.get("Event")
        if kind == "SparkListenerJobStart":
            props = ev.get("Properties") or {}
            desc = props.get("spark.job.description") or props.get("callSite.short") or ""
            jobs[ev["Job ID"]] = {"id": ev["Job ID"], "start": ev["Submission Time"] / 1e3, "desc": desc,
                                  "call": props.get("callSite.short", ""), "stages": ev.get("Stage IDs", []),
                                  "tasks": []}
            for s in ev.get("Stage IDs", []):
                stage_job[s] = ev["Job ID"]
        elif kind == "SparkListenerJobEnd":
            jobs[ev["Job ID"]]["end"] = ev["Completion Time"] / 1e3
        elif kind == "SparkListenerTaskEnd":
            info = ev["Task Info"]
            job = stage_job.get(ev["Stage ID"])
            if job is not None:
                jobs[job]["tasks"].append((ev["Stage ID"], info["Launch Time"] / 1e3, info["Finish Time"] / 1e3))
    return sorted(jobs.values(), key=lambda j: j["start"])


def one_fit(spark: Any, df: Any, store: Any, epochs: int, batch: int) -> tuple[float, float, float, Any]:
    import torch
    from estimator import _model

    from spark_hvd.estimators import TorchEstimator

    net = _model()
    est = TorchEstimator(num_proc=2, store=store, model=net, optimizer=torch.optim.Adam(net.parameters(), lr=1e-3),
                         loss="mse", feature_cols=["features"], label_cols=["y"], batch_size=batch, epochs=epochs,
                         shuffle=True, random_seed=0, partitions_per_process=4, verbose=0)
    est._rank_fn = staticmethod(profiled_rank)
    t0 = time.time()
    model = est.fit(df)
    t1 = time.time()
    return t0, t1, t1 - t0, model


def table(name: str, t0: float, t1: float, jobs: list[dict], phases: list, events: list) -> list[str]:
    """Rows (text) of one fit's profile: driver phases, Spark jobs, rank phases, all relative to the fit's start."""
    rows = [f"== {name}: {t1 - t0:.2f} s"]
    for label, a, b in sorted(phases, key=lambda p: p[1]):
        if a >= t0 - 0.01 and b <= t1 + 0.01:
            rows.append(f"  driver {label:<44} {a - t0:7.3f} .. {b - t0:7.3f}  {b - a:6.3f} s")
    for j in jobs:
        if j["start"] >= t0 - 0.01 and j.get("end", 0) <= t1 + 0.01:
            launches = sorted(t[1] for t in j["tasks"])
            first = f" first task {launches[0] - t0:7.3f}" if launches else ""
            rows.append(f"  job {j['id']:>3} {j['call'][:40]:<40} {j['start'] - t0:7.3f} .. {j['end'] - t0:7.3f}  "
                        f"{j['end'] - j['start']:6.3f} s  stages {len(j['stages'])} tasks {len(j['tasks'])}{first}")
    for ev in events:
        prof = json.loads(ev)
        rows.append(f"  rank pid {prof['pid']}: process start {prof['proc_start'] - t0:7.3f}, fn entered "
                    f"{prof['entered'] - t0:7.3f}, left {prof['left'] - t0:7.3f}, torch imported before fn: "
                    f"{prof['torch_imported_before_fn']}; {' '.join(prof.get('heavy_modules', []))}")
        for label, a, b in prof["marks"]:
            rows.append(f"    {label:<44} {a - t0:7.3f} .. {b - t0:7.3f}  {b - a:6.3f} s")
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit-rows", type=int, default=50_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--warm-fits", type=int, default=1)
    parser.add_argument("--no-warm-workers", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    events_dir = tempfile.mkdtemp(prefix="fit_profile_events_")
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName("fit-profile").config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "4").config("spark.driver.memory", "4g")
             .config("spark.python.worker.reuse", "true").config("spark.ui.showConsoleProgress", "false")
             .config("spark.eventLog.enabled", "true").config("spark.eventLog.compress", "false")
             .config("spark.eventLog.dir", "file://" + events_dir).getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    from spark_hvd.data import prepare
    from spark_hvd.estimators.common import fit as fit_mod
    from spark_hvd.runner import last_events
    from spark_hvd.runner.backend import SparkBackend
    from spark_hvd.store import Store

    _timed(fit_mod.BaseEstimator, "_check_rows", "fit checks' Spark job (_check_rows)")
    _timed(fit_mod, "_prepare_data", "prepare_data (all)")
    _timed(prepare, "_count_rows", "prepare: footers read back (_count_rows)")
    _timed(prepare, "_fingerprint", "prepare: plan key")
    _timed(SparkBackend, "run", "barrier stage (backend.run)")
    _timed(SparkBackend, "num_processes", "slot check (num_processes)")
    from pyspark.sql import DataFrameWriter

    _timed(DataFrameWriter, "parquet", "prepare: Parquet write job")
    from spark_hvd.data import arrow_write

    _timed(arrow_write, "write_splits", "prepare: Parquet write job (Python workers)")
    from spark_hvd.estimators.torch import estimator as torch_est

    _timed(torch_est.TorchEstimator, "_load_trained_model", "load the trained model")
    _timed(torch_est.TorchEstimator, "_check_model", "check/serialise the model")

    results: dict[str, Any] = {"cpus": os.cpu_count(), "load_before": os.getloadavg()}
    df = features_df(spark, args.fit_rows, seed=2).cache()
    df.count()
    if not args.no_warm_workers:
        def warm(batches):
            import torch  # noqa: F401 - the import is the point
            yield from batches

        df.mapInArrow(warm, df.schema).write.format("noop").mode("overwrite").save()
    tmp = tempfile.mkdtemp(prefix="fit_profile_")
    store = Store.create(os.path.join(tmp, "store"))
    fits = []
    for i in range(1 + args.warm_fits):
        t0, t1, secs, _ = one_fit(spark, df, store, args.epochs, args.batch)
        events = [e.metrics["_profile"] for e in last_events() if "_profile" in e.metrics]
        fits.append(("first fit (prepares)" if i == 0 else f"warm fit {i}", t0, t1, events))
    results["fit_s"] = [f[2] - f[1] for f in fits]
    results["raw"] = {"fits": fits, "phases": PHASES}
    spark.stop()
    jobs = [j for path in sorted(glob.glob(os.path.join(events_dir, "**", "*"), recursive=True))
            if os.path.isfile(path) for j in event_log_jobs(path)]
    lines = []
    for name, t0, t1, events in fits:
        lines += table(name, t0, t1, jobs, PHASES, events)
    print("\n".join(lines))
    results["profile"] = lines
    shutil.rmtree(events_dir, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    finish(results, args.out)
    return results


if __name__ == "__main__":
    main()
