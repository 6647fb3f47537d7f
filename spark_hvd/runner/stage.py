"""One attempt of a run on the driver: its barrier stage submitted and watched.

``run_attempt(spark, Attempt(...), on_event)`` starts the attempt's driver service (output, progress, failures),
submits a barrier ``mapInArrow`` over ``num_proc`` partitions of ``spark.range`` (DataFrame APIs only, so a classic
session and a Spark Connect one take the same path; ``spark_hvd.runner.cluster``) under a job tag of its own, and
watches it: the first failure reported by any rank (or a rank whose process disappears, or one that has sent
nothing for ``SPARK_HVD_LIVENESS_TIMEOUT`` seconds: its host unreachable) cancels the stage at once, so the other
ranks stop; the error raised names the rank and carries its remote type, message and traceback. The
results come back as the stage's rows (cloudpickled, one per rank; ``barrier_task`` is the task's side).

Spark Connect cannot tell the driver its free task slots: when no rank has connected within
``CONNECT_START_WAIT_S`` the stage is cancelled and ``StageNotStartedError`` says why. The secret travels inside
the pickled task function (in the plan's serialised function, never in a conf, a job tag or a description), and
the driver service listens on the driver's host (``cluster.driver_host``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from spark_hvd.runner import cluster, compat
from spark_hvd.runner.barrier_task import RESULT_SCHEMA, TaskSetup, make_mapper
from spark_hvd.runner.client import Event
from spark_hvd.runner.errors import RankFailedError, RankFailure, RunnerError, StageNotStartedError, StartTimeoutError
from spark_hvd.runner.horovod_kwargs import OutputStreams
from spark_hvd.runner.interrupt import QuietInterrupt
from spark_hvd.runner.service import DriverService
from spark_hvd.runner.slots import wait_tasks_gone

logger = logging.getLogger(__name__)

#: Spark Connect (slots unknown): seconds for the first rank to connect before the stage is given up as one that
#: cannot get its slots (Spark would otherwise retry the barrier stage's slot check for up to 10 minutes).
CONNECT_START_WAIT_S = float(os.environ.get("SPARK_HVD_CONNECT_START_WAIT", "60"))
#: Seconds a rank may send nothing to the driver service (it says it is alive every second) before it is blamed as
#: unreachable and the stage cancelled: a host whose link is cut is named in this time instead of after its peers'
#: collective timeout (``SPARK_HVD_TIMEOUT``); 0 turns the check off. Read at each attempt.
LIVENESS_ENV = "SPARK_HVD_LIVENESS_TIMEOUT"
LIVENESS_TIMEOUT_S = 10.0
#: Seconds a failed attempt waits for the reports of its other ranks, so that it blames the cause.
REPORTS_WAIT_S = 10.0
#: Seconds to wait for the Spark job to end after it was cancelled.
CANCEL_WAIT_S = 120.0
#: Seconds a failed run waits for its killed tasks to leave their slots.
TASKS_GONE_WAIT_S = 60.0


@dataclass(frozen=True)
class Attempt:
    """One try of a job: what every task of its barrier stage gets, and how the driver watches it.

    ``payload``: ``(fn, args, kwargs)`` cloudpickled; ``job_id``: this attempt's id (the service refuses other
    jobs' ranks); ``attempt``: its number (``SPARK_HVD_RUN_ATTEMPT`` on the ranks, ``Event.attempt``);
    ``start_timeout``: seconds for every rank to connect; ``env``, ``use_gpu``, ``verbose``: as for ``run``.
    """

    payload: bytes
    num_proc: int
    secret: bytes
    job_id: str
    attempt: int = 0
    env: Mapping[str, str] = field(default_factory=dict)
    start_timeout: float = 600.0
    use_gpu: bool | None = None
    verbose: int = 1
    #: frames between the ranks and with the driver's service are encrypted (``run(encrypt=...)``)
    encrypt: bool = False
    #: Horovod's ``stdout`` / ``stderr`` streams for the ranks' output lines (None: the driver's, by ``verbose``)
    output: OutputStreams | None = None


def stage_tag(job_id: str) -> str:
    """The job tag (and, on classic, the job group) of the barrier stage of job ``job_id``."""
    return f"spark_hvd-{job_id}"


class Stage:
    """The barrier stage of one attempt: submitted from its own thread under a job tag (and, on classic, a job
    group, whose running tasks the status tracker can count; classic Spark 3.5 has the group only:
    ``compat.tag_job``), cancelled from the watching thread."""

    def __init__(self, spark: Any, job_id: str) -> None:
        self.spark = spark
        self.connect = cluster.is_connect(spark)
        self.tag = stage_tag(job_id)

    def collect(self, mapper: Callable, num_proc: int) -> list[tuple[int, bytes]]:
        """Run the stage (in the calling thread); its rows as ``(rank, result bytes)``."""
        with compat.tag_job(self.spark, self.tag, f"spark_hvd run ({num_proc} ranks)"):
            frame = self.spark.range(0, num_proc, 1, num_proc).mapInArrow(mapper, RESULT_SCHEMA, barrier=True)
            return [(int(rank), bytes(result)) for rank, result in frame.collect()]

    def cancel(self) -> None:
        compat.cancel_job(self.spark, self.tag)

    def wait_gone(self, timeout_s: float, leave: int = 0) -> None:
        """Wait (bounded) until no task of the stage runs, or at most ``leave`` (``wait_tasks_gone``; classic:
        Connect's interrupt returns once it is done)."""
        if not self.connect:
            wait_tasks_gone(self.spark.sparkContext, self.tag, timeout_s, leave)


def run_attempt(spark: Any, attempt: Attempt, on_event: Callable[[Event], None],
                handlers: dict[str, Callable[[int, Any], Any]] | None = None) -> list[Any]:
    """Run ``attempt``'s barrier stage with its driver service (``handlers``: the service's request handlers) and
    return the results by rank; raise as the module docstring says."""
    from pyspark import InheritableThread

    num_proc, job_id, start_timeout = attempt.num_proc, attempt.job_id, attempt.start_timeout
    liveness_s = liveness_timeout_s()
    stage = Stage(spark, job_id)
    cancelled = threading.Event()

    def cancel(failure: RankFailure | None = None) -> None:
        if cancelled.is_set():
            return
        cancelled.set()
        service.mark_cancelled()
        if failure is not None:
            logger.info("spark_hvd: %s; cancelling the other ranks", failure.describe())
        try:
            stage.cancel()
        except Exception:
            logger.exception("spark_hvd: cancelling the stage %s failed", stage.tag)

    service = DriverService(attempt.secret, num_proc, job_id=job_id, verbose=attempt.verbose, on_event=on_event,
                            on_failure=cancel, attempt=attempt.attempt, handlers=handlers, encrypt=attempt.encrypt,
                            output=attempt.output)
    _, port = service.start()
    setup = TaskSetup(f"{cluster.driver_host(spark)}:{port}", attempt.secret, job_id, attempt.attempt, num_proc,
                      dict(attempt.env), attempt.use_gpu, attempt.payload, tee=not cluster.is_local_master(spark),
                      encrypt=attempt.encrypt, start_timeout=start_timeout)
    slots_unknown = stage.connect and cluster.total_slots(spark) is None
    outcome: dict[str, Any] = {}

    def submit() -> None:
        try:
            outcome["results"] = stage.collect(make_mapper(setup), num_proc)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = exc
        finally:
            service.changed.set()

    # classic: the stage's thread inherits the caller's local properties (job description, pool ...); Connect
    # threads carry nothing but the tag, which collect() sets
    thread_class = threading.Thread if stage.connect else InheritableThread
    thread = thread_class(target=submit, name=f"spark_hvd-run-{job_id}", daemon=True)
    quiet = QuietInterrupt(spark).start()  # a Ctrl-C without Spark's warnings for every killed task
    try:
        thread.start()
        began = time.monotonic()
        started_by = began + start_timeout
        timeout: StartTimeoutError | None = None
        while thread.is_alive():
            try:
                service.changed.wait(0.5)
            except KeyboardInterrupt:  # the caller gave up: stop the ranks rather than leave them running
                cancel()
                thread.join(CANCEL_WAIT_S)  # bounded: the job's end, then its tasks leaving their slots
                stage.wait_gone(TASKS_GONE_WAIT_S)
                raise
            service.changed.clear()
            if liveness_s and not cancelled.is_set():
                service.check_liveness(liveness_s)  # a failure found cancels the stage (on_failure)
            if service.failures and not cancelled.is_set():
                cancel()
            if not cancelled.is_set() and len(service.started) < num_proc:
                now = time.monotonic()
                if slots_unknown and not service.started and now > began + min(CONNECT_START_WAIT_S,
                                                                                 start_timeout):
                    timeout = StageNotStartedError(num_proc, min(CONNECT_START_WAIT_S, start_timeout))
                elif now > started_by:
                    timeout = StartTimeoutError(sorted(set(range(num_proc)) - service.started), start_timeout)
                if timeout is not None:
                    cancel()
            if cancelled.is_set():
                thread.join(CANCEL_WAIT_S)
                if thread.is_alive():
                    logger.warning("spark_hvd: stage %s still running %.0f s after cancellation", stage.tag,
                                   CANCEL_WAIT_S)
                break
        if timeout is not None:
            raise timeout
        if "results" in outcome and not cancelled.is_set():
            service.wait_finished(30.0)  # let the last output lines reach the console
            by_rank = dict(outcome["results"])
            return [cloudpickle.loads(by_rank[r]) for r in range(num_proc)]
        service.wait_finished(REPORTS_WAIT_S, only_started=True)  # the ranks found unreachable are not waited for
        # a rank still silent now is on a host that cannot be reached (or stuck): it is blamed, and its task,
        # which Spark cannot kill until the host answers or is declared lost, is not waited for (its slot stays busy)
        unreachable = service.blame_silent()
        stage.wait_gone(TASKS_GONE_WAIT_S,
                        leave=len(service.unreachable) + (len(service.silent()) if unreachable else 0))
        root = service.root_failure()
        detail = spark_message(outcome.get("error"))
        if root is not None:
            raise RankFailedError(root, service.sorted_failures(), detail) from None
        raise RunnerError(f"spark_hvd run {job_id} failed before any rank reported an error: {detail}")
    finally:
        quiet.stop()
        service.stop()


def liveness_timeout_s() -> float:
    """``SPARK_HVD_LIVENESS_TIMEOUT`` from the driver's environment (default ``LIVENESS_TIMEOUT_S``; 0: off)."""
    raw = os.environ.get(LIVENESS_ENV, "").strip()
    try:
        value = float(raw) if raw else LIVENESS_TIMEOUT_S
    except ValueError:
        raise RunnerError(f"{LIVENESS_ENV}={raw!r} is not a number of seconds") from None
    if value < 0:
        raise RunnerError(f"{LIVENESS_ENV}={raw!r} must be >= 0 (0 turns the check off)")
    return value


def spark_message(exc: BaseException | None, limit: int = 2000) -> str:
    """The useful head of a Spark / Py4J exception (the JVM stack trace left out)."""
    if exc is None:
        return ""
    java = getattr(exc, "java_exception", None)
    text = None
    if java is not None:
        try:
            text = str(java.getMessage())
        except Exception:
            text = None
    text = text or str(exc)
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("at ")]
    text = "\n".join(lines)
    return text if len(text) <= limit else text[:limit] + " ..."
