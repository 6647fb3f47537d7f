"""Task slots of a Spark session: how many are free, the check that ``num_proc`` of them are (before any job
starts), and the wait for a failed stage's tasks to leave theirs."""

from __future__ import annotations

import logging
import operator
import os
import threading
import time
from typing import Any

from spark_hvd.runner import cluster, compat
from spark_hvd.runner.errors import NotEnoughSlotsError, RunnerError, SlotsTimeoutError
from spark_hvd.runner.slot_ledger import LEDGER

logger = logging.getLogger(__name__)

#: Seconds run() waits for executors to register when the cluster has fewer slots than asked (a fresh
#: local-cluster / standalone application); free slots short because of other running jobs fail after a short grace.
SLOT_WAIT_S = float(os.environ.get("SPARK_HVD_SLOT_WAIT", "10"))
#: Seconds ``check_slots`` gives slots that exist but are busy before it fails.
BUSY_SLOT_GRACE_S = 3.0


def running_tasks(sc: Any) -> tuple[int, bool]:
    """``(tasks running now, exact)``. Exact: the task scheduler's own count, which a task leaves the moment its
    slot is free. Else (a scheduler that cannot be asked) the status tracker's, which is not exact: it learns of
    tasks from the listener bus and writes an executor's or a stage's count to its store at most every 100 ms
    (``spark.ui.liveUpdate.period``; a skipped write waits for the next event or heartbeat), so a task that
    started or ended moments ago can be missing or still counted for seconds."""
    jsc = sc._jsc.sc()
    try:
        per_executor = compat.scala_map_as_java(sc._jvm, jsc.taskScheduler().runningTasksByExecutors())
        return sum(int(n) for n in per_executor.values()), True
    except Exception:  # not Spark's TaskSchedulerImpl, or its Scala API moved
        logger.debug("spark_hvd: the task scheduler's running tasks could not be read", exc_info=True)
        return sum(int(info.numRunningTasks()) for info in jsc.statusTracker().getExecutorInfos()), False


def total_slots(sc: Any) -> int:
    """Task slots of the default resource profile (all executors)."""
    jsc = sc._jsc.sc()
    return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))


def slots(sc: Any) -> tuple[int, int]:
    """``(free, total)`` task slots of the default resource profile, running tasks subtracted."""
    total = total_slots(sc)
    return max(0, total - running_tasks(sc)[0]), total


def is_local_mode(sc: Any) -> bool:
    """``local`` / ``local[N]``: the executor lives in the driver's JVM (not ``local-cluster``)."""
    master = str(sc.master)
    return master == "local" or master.startswith("local[")


def check_slots(sc: Any, num_proc: int, wait_s: float = SLOT_WAIT_S, *, start_wait: float | None = None) -> int:
    """Raise ``NotEnoughSlotsError`` (with both numbers) unless ``num_proc`` task slots are free.

    ``sc`` is a classic ``SparkContext``. While the cluster's total is below ``num_proc`` (executors still
    registering), waits up to ``wait_s`` (not in local mode, whose slots never change). Slots that exist but are
    busy get ``BUSY_SLOT_GRACE_S`` (the tasks of a stage just cancelled, a previous run's, take a moment to go),
    then the error; a ``wait_s`` longer than ``SLOT_WAIT_S`` (``run_elastic`` waiting for slots) waits for them
    that long. Busy slots while this process's other runs hold some (``slot_ledger``) are no error: the run waits
    for its turn when it launches. Returns the number of free slots.

    ``start_wait`` (seconds; ``run``'s ``start_timeout``, see ``spark.slot_wait_s``) replaces both waits with
    Horovod's: executors may be added (autoscaling, dynamic allocation) and other jobs may give slots back, so the
    slots are polled (every ``SLOT_POLL_S``) until ``num_proc`` are free or ``start_wait`` has passed, then
    ``SlotsTimeoutError`` ("Timed out waiting for Spark tasks to start", both numbers). No Spark job is started.
    """
    if start_wait is not None:
        return _wait_for_slots(sc, num_proc, start_wait)
    if is_local_mode(sc) and wait_s <= SLOT_WAIT_S:
        wait_s = 0.0
    start = time.monotonic()
    free, total = slots(sc)
    while free < num_proc:
        waited = time.monotonic() - start
        if total >= num_proc and wait_s <= SLOT_WAIT_S:
            held = LEDGER.held(session_key(sc)) if LEDGER.busy() else 0
            if held:
                logger.info("spark_hvd: %d of %d task slots are free and %d are held by this process's other runs: "
                            "the run of %d processes will wait for its turn", free, total, held, num_proc)
                return free
            if waited >= BUSY_SLOT_GRACE_S:
                break  # the slots exist but stay busy with other work: fail rather than wait
        elif waited >= wait_s:
            break
        threading.Event().wait(0.25)
        free, total = slots(sc)
    if free < num_proc:
        raise NotEnoughSlotsError(num_proc, free, total)
    return free


#: Seconds between two looks at the slots while ``check_slots`` waits ``start_wait``.
SLOT_POLL_S = 0.5


def _wait_for_slots(sc: Any, num_proc: int, start_wait: float) -> int:
    """``check_slots`` with ``start_wait``: Horovod's wait for the tasks to start, as a poll of the slots."""
    deadline = time.monotonic() + start_wait
    told = False
    free, total = slots(sc)
    while free < num_proc:
        if total >= num_proc and LEDGER.busy() and LEDGER.held(session_key(sc)):
            return free  # this process's other runs hold the slots it lacks: it waits its turn at launch
        left = deadline - time.monotonic()
        if left <= 0:
            raise SlotsTimeoutError(num_proc, free, total, start_wait)
        if not told:
            logger.warning("spark_hvd: num_proc=%d needs as many free task slots; %d of %d are free: waiting up "
                           "to start_timeout=%g s for executors to be added or slots to be given back", num_proc,
                           free, total, start_wait)
            told = True
        threading.Event().wait(min(SLOT_POLL_S, left))
        free, total = slots(sc)
    if told:
        logger.warning("spark_hvd: %d task slots free after %.1f s", free, start_wait - (deadline - time.monotonic()))
    return free


def session_key(spark_or_sc: Any) -> str:
    """The key of a session's slots in ``slot_ledger.LEDGER``: its Spark application (classic ``SparkContext`` or
    session), or the Connect session's id."""
    sc = spark_or_sc if hasattr(spark_or_sc, "applicationId") else None
    if sc is None and not cluster.is_connect(spark_or_sc):
        sc = getattr(spark_or_sc, "sparkContext", None)
    if sc is not None:
        return f"app:{sc.applicationId}"
    return f"connect:{getattr(spark_or_sc, 'session_id', id(spark_or_sc))}"


def session_total_slots(spark: Any) -> int | None:
    """All task slots of the session (classic: the default resource profile's; Connect: a ``local[N]`` master's N,
    else None)."""
    return cluster.total_slots(spark) if cluster.is_connect(spark) else total_slots(spark.sparkContext)


def check_session_slots(spark: Any, num_proc: int, wait_s: float = SLOT_WAIT_S, *,
                        start_wait: float | None = None) -> int | None:
    """``check_slots`` for a classic session; on Spark Connect, which cannot tell the free slots, the total of a
    ``local[N]`` master is checked (None is returned where the session says nothing: the stage itself is then
    the check, ``StageNotStartedError``)."""
    if not cluster.is_connect(spark):
        return check_slots(spark.sparkContext, num_proc, wait_s, start_wait=start_wait)
    total = cluster.total_slots(spark)
    if total is not None and total < num_proc:
        raise NotEnoughSlotsError(num_proc, total, total)
    return total


def resolve_num_proc(spark: Any, num_proc: Any = None, start_wait: float | None = None) -> int:
    """``num_proc`` checked to be a positive integer (default: the session's default parallelism), and its task
    slots checked (``check_session_slots``, waiting ``start_wait`` seconds for them where given). ``run`` calls it
    first; a caller that already did (an estimator's ``SparkBackend``) hands the result to ``run_checked``."""
    if num_proc is None:
        num_proc = cluster.default_parallelism(spark)
    try:
        num_proc = operator.index(num_proc)
    except TypeError:
        raise RunnerError(f"num_proc must be a positive integer, got {num_proc!r}") from None
    if num_proc < 1:
        raise RunnerError(f"num_proc must be a positive integer, got {num_proc!r}")
    check_session_slots(spark, num_proc, start_wait=start_wait)
    return num_proc


def free_slots(spark: Any, unknown: int) -> int:
    """Free task slots now: classic from the status tracker; Connect the ``local[N]`` total, else ``unknown``."""
    if not cluster.is_connect(spark):
        return slots(spark.sparkContext)[0]
    total = cluster.total_slots(spark)
    return unknown if total is None else total


def group_tasks(sc: Any, group: str) -> int:
    """Running tasks of the job group, as the status tracker counts them."""
    tracker = sc.statusTracker()
    active = 0
    for job_id in tracker.getJobIdsForGroup(group):
        job = tracker.getJobInfo(job_id)
        for stage_id in (job.stageIds if job else []):
            stage = tracker.getStageInfo(stage_id)
            active += stage.numActiveTasks if stage else 0
    return active


def free_slots_beside(sc: Any, group: str, ours: int) -> int:
    """Free task slots while the job group runs ``ours`` tasks (classic sessions), asked by a running attempt.

    With the scheduler's exact count, every running task (``ours`` among them) is subtracted from the total. With
    the status tracker's, ``ours`` may not be counted yet, so the group's tasks, counted or not, are taken as
    ``ours``, and only the other jobs' tasks as the tracker counts them (its executor and stage counts can
    disagree for seconds, which is why the exact count comes first).
    """
    total = total_slots(sc)
    running, exact = running_tasks(sc)
    if exact:
        return max(0, total - running)
    others = max(0, running - group_tasks(sc, group))
    return max(0, total - others - ours)


def wait_tasks_gone(sc: Any, group: str, timeout_s: float, leave: int = 0) -> bool:
    """Wait (bounded) until no task of the job group is running, so a following run finds its slots free; with
    ``leave``, until at most that many are (the tasks of ranks whose host is unreachable: their executor cannot be
    told to kill them until it comes back or Spark declares it lost; their slots stay counted as busy)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            active = group_tasks(sc, group)
        except Exception:  # the status tracker is best effort
            logger.debug("spark_hvd: status tracker query failed", exc_info=True)
            return False
        if active <= leave:
            return True
        if time.monotonic() > deadline:
            logger.warning("spark_hvd: %d task(s) of job group %s still running %.0f s after the run failed",
                           active, group, timeout_s)
            return False
        threading.Event().wait(0.2)
