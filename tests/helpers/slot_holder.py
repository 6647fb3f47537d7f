"""A Spark job that holds one task slot, for elastic fits whose lost rank's slot must "not come back".

``take_a_slot_at_the_reset(spark, monkeypatch, directory)`` patches ``run_elastic``'s slot wait so that, before the
driver counts the free slots for its first relaunch, a one-task job takes one slot and holds it until
``<directory>/release`` exists; it returns once Spark itself counts that task as running (no timing assumption).
``fit_losing_a_slot`` runs a fit under it.
The job's task runs on an executor, so this module travels by value (cloudpickle).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: seconds the holder may take to start, and the longest it holds its slot
START_S, HOLD_S = 120.0, 600.0


def _hold(release: str):
    def hold(_: Any) -> None:
        deadline = time.monotonic() + HOLD_S
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.05)
    return hold


def hold_a_slot(spark: Any, directory: str, group: str) -> threading.Thread:
    """Start a one-task job (job group ``group``) that holds a slot until ``<directory>/release`` exists; return its
    thread once Spark's status tracker counts the task as running."""
    sc = spark.sparkContext

    def job() -> None:
        sc.setJobGroup(group, "holds a task slot")
        sc.parallelize([0], 1).foreach(_hold(os.path.join(directory, "release")))

    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    tracker, deadline = sc.statusTracker(), time.monotonic() + START_S
    while time.monotonic() < deadline:
        jobs = [tracker.getJobInfo(j) for j in tracker.getJobIdsForGroup(group)]
        stages = [tracker.getStageInfo(s) for j in jobs if j for s in j.stageIds]
        if any(s is not None and s.numActiveTasks == 1 for s in stages):
            return thread
        time.sleep(0.1)
    raise AssertionError(f"the slot holder did not start within {START_S:g} s")


def take_a_slot_at_the_reset(spark: Any, monkeypatch: Any, directory: str, group: str) -> list[threading.Thread]:
    """Before ``run_elastic`` counts the free slots for its first relaunch, a job takes one slot (``hold_a_slot``):
    the lost rank's slot does not come back. Returns the list that will hold the job's thread."""
    import spark_hvd.runner.elastic as elastic

    real, threads = elastic._wait_slots, []

    def wait_slots(spark_: Any, low: int, high: int, timeout_s: float, why: str) -> int:
        if why.startswith("reset") and not threads:
            threads.append(hold_a_slot(spark, directory, group))
        return real(spark_, low, high, timeout_s, why)

    monkeypatch.setattr(elastic, "_wait_slots", wait_slots)
    return threads


def fit_losing_a_slot(spark: Any, monkeypatch: Any, estimator: Any, df: Any, directory: str, group: str) -> Any:
    """``estimator.fit(df)`` while ``take_a_slot_at_the_reset`` takes the lost rank's slot; afterwards the holder is
    released and joined, and a rank must have died (``<directory>/killed``, see ``helpers.estimators.die_once``) and
    been relaunched. Returns the fitted model."""
    threads = take_a_slot_at_the_reset(spark, monkeypatch, directory, group)
    try:
        fitted = estimator.fit(df)
    finally:
        open(os.path.join(directory, "release"), "w").close()
        for t in threads:
            t.join(60)
    assert os.path.exists(os.path.join(directory, "killed")) and threads, "rank 1 did not die, or no relaunch happened"
    return fitted
