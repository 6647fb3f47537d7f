"""``run(fn, num_proc)``: one Spark barrier stage of ``num_proc`` tasks, each a rank of a spark_hvd job.

Driver side: check the free task slots, create a per-job secret, start the driver service (output, progress,
failures), submit a barrier ``mapInArrow`` over ``num_proc`` partitions of ``spark.range`` (DataFrame APIs only,
so a classic session and a Spark Connect one take the same path; ``spark_hvd.runner.cluster``) under a job tag of
its own, and watch: the first failure reported by any rank (or a rank whose process disappears) cancels the
stage at once, so the other ranks stop; the error raised names the rank and carries its remote type, message and
traceback. The results come back as the stage's rows (cloudpickled, one per rank).

Spark Connect cannot tell the driver its free task slots. There the check is the total of a ``local[N]`` master,
else the stage itself: when no rank has connected within ``CONNECT_START_WAIT_S`` the stage is cancelled and
``StageNotStartedError`` says why. The secret travels inside the pickled task function (as on classic: in the
plan's serialised function, never in a conf, a job tag or a description), and the driver service listens on
the driver's host (``cluster.driver_host``).

Task side (``_run_rank``): rank = partition id; the ranks exchange their host names and the GPU address Spark
assigned to each task through ``BarrierTaskContext.allGather`` (HMAC-signed with the job's secret:
``BarrierRendezvous``) to get local rank, local size, cross rank and cross size and to check that no two ranks of a
host share a GPU; the task writes its ``JobEnv`` (``SPARK_HVD_*``) into the environment, initialises
``spark_hvd.core`` over the same allGather rendezvous (a user's own ``hvd.init()`` is then a no-op), forwards
its stdout/stderr to the driver and runs ``fn``. Everything is undone afterwards, since Spark reuses Python workers.

Over 400 lines on purpose: the driver half and the task half of one launch protocol (the allGather rendezvous,
the result rows, the cancellation) are kept side by side.
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import operator
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cloudpickle

from spark_hvd import pickling
from spark_hvd.core.addresses import host_identity
from spark_hvd.core.backend import Rendezvous
from spark_hvd.core.errors import AuthenticationError
from spark_hvd.core.jobenv import JobEnv, check_distinct_gpus, topology
from spark_hvd.core.wire import make_secret, sign
from spark_hvd.runner import client as _client
from spark_hvd.runner import cluster
from spark_hvd.runner.client import Event, OutputForwarder, ServiceClient
from spark_hvd.runner.errors import (
    NotEnoughSlotsError,
    RankFailedError,
    RankFailure,
    RunnerError,
    StageNotStartedError,
    StartTimeoutError,
)
from spark_hvd.runner.service import DriverService

logger = logging.getLogger(__name__)

#: Seconds run() waits for executors to register when the cluster has fewer slots than asked (a fresh
#: local-cluster / standalone application); free slots short because of other running jobs fail after a short grace.
SLOT_WAIT_S = float(os.environ.get("SPARK_HVD_SLOT_WAIT", "10"))
#: Seconds ``check_slots`` gives slots that exist but are busy before it fails.
BUSY_SLOT_GRACE_S = 3.0
#: Spark Connect (slots unknown): seconds for the first rank to connect before the stage is given up as one that
#: cannot get its slots (Spark would otherwise retry the barrier stage's slot check for up to 10 minutes).
CONNECT_START_WAIT_S = float(os.environ.get("SPARK_HVD_CONNECT_START_WAIT", "60"))
#: Environment fallback of ``run(start_timeout=...)`` (Horovod's name).
START_TIMEOUT_ENV = "HOROVOD_SPARK_START_TIMEOUT"
#: Seconds to wait for the Spark job to end after it was cancelled.
CANCEL_WAIT_S = 120.0
#: Seconds a failed run waits for its killed tasks to leave their slots.
TASKS_GONE_WAIT_S = 60.0

_last_events: list[Event] = []


def last_events() -> list[Event]:
    """The progress events (``report(...)``) of the last ``run`` in this driver process, in arrival order."""
    return list(_last_events)


# ---------------------------------------------------------------------------------------------- rendezvous
class BarrierRendezvous(Rendezvous):
    """A ``Rendezvous`` over Spark's ``BarrierTaskContext.allGather``, each message signed with the job's secret.

    ``all_gather`` is ``BarrierTaskContext.get().allGather`` (injectable for tests). Each message carries its rank,
    a round number and an HMAC over (job id, round, rank, value); a message that fails the check raises
    ``AuthenticationError`` naming the rank slot it claimed, and its value is never used.
    """

    def __init__(self, all_gather: Callable[[str], list[str]], secret: bytes, job_id: str) -> None:
        self._all_gather = all_gather
        self._secret = secret
        self._job_id = job_id
        self._round = 0

    def _mac(self, round_no: int, rank: int, value: bytes) -> str:
        return sign(self._secret, b"spark_hvd-barrier-rendezvous\0", self._job_id.encode(), b"\0",
                    f"{round_no}:{rank}:".encode(), value).hex()

    def exchange(self, rank: int, size: int, value: bytes) -> list[bytes]:
        round_no = self._round
        self._round += 1
        message = json.dumps({"rank": rank, "round": round_no, "value": base64.b64encode(value).decode(),
                              "mac": self._mac(round_no, rank, value)})
        replies = self._all_gather(message)
        if len(replies) != size:
            raise RunnerError(f"barrier rendezvous: expected {size} messages, got {len(replies)}")
        values: list[bytes] = []
        for slot, reply in enumerate(replies):
            try:
                parsed = json.loads(reply)
                sender, got_round = int(parsed["rank"]), int(parsed["round"])
                got_value = base64.b64decode(parsed["value"], validate=True)
                mac = str(parsed["mac"])
            except (ValueError, KeyError, TypeError) as exc:
                logger.warning("barrier rendezvous: dropped a malformed message in rank %d's slot", slot)
                raise AuthenticationError(f"barrier rendezvous: the message of rank {slot} is malformed") from exc
            if (sender != slot or got_round != round_no
                    or not hmac.compare_digest(mac, self._mac(got_round, sender, got_value))):
                logger.warning("barrier rendezvous: dropped a message in rank %d's slot that fails the HMAC check",
                               slot)
                raise AuthenticationError(
                    f"barrier rendezvous: the message of rank {slot} failed the HMAC check (forged, or from another "
                    f"job); rank {rank} refuses to join")
            values.append(got_value)
        return values


# ---------------------------------------------------------------------------------------------- task side
@dataclass(frozen=True)
class _TaskSetup:
    service_address: str
    secret: bytes
    job_id: str
    attempt: int
    num_proc: int
    env: dict[str, str]
    use_gpu: bool | None
    payload: bytes
    tee: bool


def _assigned_gpu(ctx: Any) -> str | None:
    """The first GPU address Spark assigned to this task (``resources()["gpu"]``), or None."""
    try:
        resources = ctx.resources()
    except Exception:  # older contexts / no resource support
        resources = {}
    gpu = resources.get("gpu")
    addresses = list(gpu.addresses) if gpu is not None else []
    return str(addresses[0]).strip() if addresses else None


def task_gpus(hosts: Sequence[str], assigned: Sequence[str | None], use_gpu: bool | None) -> list[str | None]:
    """Every rank's GPU by the runner's policy: the address Spark assigned; with ``use_gpu=True`` and none
    assigned, the local rank; with ``use_gpu=False``, none. Two ranks of one host on one GPU raise ``RunnerError``
    naming them (never wrapped around)."""
    gpus: list[str | None] = []
    for rank, gpu in enumerate(assigned):
        if use_gpu is False:
            gpu = None
        elif gpu is None and use_gpu:
            gpu = str(topology(hosts, rank)[0])
        gpus.append(gpu)
    try:
        check_distinct_gpus(hosts, gpus)
    except ValueError as exc:
        raise RunnerError(str(exc)) from None
    return gpus


#: The rows of the barrier stage: one per rank, its result cloudpickled.
RESULT_SCHEMA = "rank long, result binary"


def _make_mapper(setup: _TaskSetup) -> Callable:
    """The barrier ``mapInArrow`` function: runs the rank, yields its one result row."""

    def mapper(batches: Any) -> Any:
        import pyarrow as pa
        from pyspark import BarrierTaskContext

        for _ in batches:  # the input is the rank's own id only: drain it
            pass
        rank, payload = _run_rank(BarrierTaskContext.get(), setup)
        yield pa.RecordBatch.from_arrays([pa.array([rank], pa.int64()), pa.array([payload], pa.binary())],
                                         names=["rank", "result"])

    return mapper


def _run_rank(ctx: Any, setup: _TaskSetup) -> tuple[int, bytes]:
    rank = ctx.partitionId()
    size = setup.num_proc
    if ctx.attemptNumber() > 0:
        raise RunnerError(f"rank {rank}: Spark retried this barrier task (attempt {ctx.attemptNumber()}); spark_hvd "
                          f"does not resume a rank alone: the run fails, use run(max_retries=...) to run it again")
    client = ServiceClient(setup.service_address, setup.secret, setup.job_id, rank, attempt=setup.attempt)
    forwarder = OutputForwarder(client, tee=setup.tee)
    saved_env: dict[str, str | None] = {}
    error: BaseException | None = None
    result: Any = None
    core = None
    try:
        forwarder.start()
        rendezvous = BarrierRendezvous(ctx.allGather, setup.secret, setup.job_id)
        mine = json.dumps([host_identity(), _assigned_gpu(ctx)]).encode()
        hosts, assigned = zip(*(json.loads(v) for v in rendezvous.exchange(rank, size, mine)), strict=True)
        local_rank, local_size, cross_rank, cross_size = topology(hosts, rank)
        job = JobEnv(rank=rank, size=size, local_rank=local_rank, local_size=local_size, cross_rank=cross_rank,
                     cross_size=cross_size, job_id=setup.job_id, secret=setup.secret,
                     service_address=setup.service_address, attempt=setup.attempt,
                     gpu=task_gpus(hosts, assigned, setup.use_gpu)[rank])
        env = job.to_env()
        env.update(setup.env)
        for key, value in env.items():
            saved_env[key] = os.environ.get(key)
            os.environ[key] = value
        _client.set_client(client)
        fn, args, kwargs = cloudpickle.loads(setup.payload)
        import spark_hvd.core as core

        core.init(rendezvous=rendezvous, rank=rank, size=size, secret=setup.secret, job_id=setup.job_id)
        result = fn(*args, **kwargs)
        payload = cloudpickle.dumps(result)
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the driver, then to Spark
        error = exc
        # tell the driver before shutting the core down: the peers' errors that the shutdown causes must
        # arrive after this rank's own, so the driver names the cause and not a consequence
        forwarder.stop()
        client.send_error(error)
    finally:
        if core is not None:
            try:
                core.shutdown()
            except Exception:
                logger.exception("rank %d: spark_hvd.core.shutdown() failed", rank)
        _client.set_client(None)
        forwarder.stop()
        for key, old in saved_env.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
        if error is None:
            client.send_done()
        client.close()
    if error is not None:
        raise error
    return rank, payload


# ---------------------------------------------------------------------------------------------- driver side
def _slots(sc: Any) -> tuple[int, int]:
    """``(free, total)`` task slots of the default resource profile, running tasks subtracted."""
    jsc = sc._jsc.sc()
    profile = jsc.resourceProfileManager().defaultResourceProfile()
    total = int(jsc.maxNumConcurrentTasks(profile))
    running = sum(int(info.numRunningTasks()) for info in jsc.statusTracker().getExecutorInfos())
    return max(0, total - running), total


def _is_local_mode(sc: Any) -> bool:
    """``local`` / ``local[N]``: the executor lives in the driver's JVM (not ``local-cluster``)."""
    master = str(sc.master)
    return master == "local" or master.startswith("local[")


def check_slots(sc: Any, num_proc: int, wait_s: float = SLOT_WAIT_S) -> int:
    """Raise ``NotEnoughSlotsError`` (with both numbers) unless ``num_proc`` task slots are free.

    ``sc`` is a classic ``SparkContext``. While the cluster's total is below ``num_proc`` (executors still
    registering), waits up to ``wait_s`` (not in local mode, whose slots never change). Slots that exist but are
    busy get ``BUSY_SLOT_GRACE_S`` (the tasks of a stage just cancelled, a previous run's, take a moment to go),
    then the error; a ``wait_s`` longer than ``SLOT_WAIT_S`` (``run_elastic`` waiting for slots) waits for them
    that long. Returns the number of free slots.
    """
    if _is_local_mode(sc) and wait_s <= SLOT_WAIT_S:
        wait_s = 0.0
    start = time.monotonic()
    free, total = _slots(sc)
    while free < num_proc:
        waited = time.monotonic() - start
        if total >= num_proc and wait_s <= SLOT_WAIT_S:
            if waited >= BUSY_SLOT_GRACE_S:
                break  # the slots exist but stay busy with other work: fail rather than wait
        elif waited >= wait_s:
            break
        threading.Event().wait(0.25)
        free, total = _slots(sc)
    if free < num_proc:
        raise NotEnoughSlotsError(num_proc, free, total)
    return free


def check_session_slots(spark: Any, num_proc: int, wait_s: float = SLOT_WAIT_S) -> int | None:
    """``check_slots`` for a classic session; on Spark Connect, which cannot tell the free slots, the total of a
    ``local[N]`` master is checked (None is returned where the session says nothing: the stage itself is then
    the check, ``StageNotStartedError``)."""
    if not cluster.is_connect(spark):
        return check_slots(spark.sparkContext, num_proc, wait_s)
    total = cluster.total_slots(spark)
    if total is not None and total < num_proc:
        raise NotEnoughSlotsError(num_proc, total, total)
    return total


def resolve_num_proc(spark: Any, num_proc: Any = None) -> int:
    """``num_proc`` checked to be a positive integer (default: the session's default parallelism), and its task
    slots checked (``check_session_slots``)."""
    if num_proc is None:
        num_proc = cluster.default_parallelism(spark)
    try:
        num_proc = operator.index(num_proc)
    except TypeError:
        raise RunnerError(f"num_proc must be a positive integer, got {num_proc!r}") from None
    if num_proc < 1:
        raise RunnerError(f"num_proc must be a positive integer, got {num_proc!r}")
    check_session_slots(spark, num_proc)
    return num_proc


def env_seconds(names: Sequence[str], default: float) -> float:
    """The first of the environment variables ``names`` that is set, as a positive number of seconds; else
    ``default``. A value that is not one raises ``RunnerError`` naming the variable."""
    for name in names:
        raw = os.environ.get(name)
        if raw:
            try:
                seconds = float(raw)
            except ValueError:
                raise RunnerError(f"{name}={raw!r} is not a number of seconds") from None
            if seconds <= 0:
                raise RunnerError(f"{name}={raw!r} must be a positive number of seconds")
            return seconds
    return default


def _start_timeout(value: float | None) -> float:
    """``start_timeout`` as given, else ``SPARK_HVD_START_TIMEOUT`` / ``HOROVOD_SPARK_START_TIMEOUT``, else 600."""
    if value is not None:
        return float(value)
    return env_seconds(("SPARK_HVD_START_TIMEOUT", START_TIMEOUT_ENV), 600.0)


def checked_env(env: dict[str, str] | None) -> dict[str, str]:
    """A copy of ``env``; ``RunnerError`` unless it maps str to str."""
    env = dict(env or {})
    for key, value in env.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise RunnerError(f"env must map str to str; {key!r}: {value!r} is not")
    return env


def pickled(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> bytes:
    """``(fn, args, kwargs)`` pickled for the tasks (``spark_hvd.pickling``: code shipped by value keeps its source
    lines); ``RunnerError`` when they cannot be."""
    try:
        return pickling.dumps((fn, args, kwargs))
    except Exception as exc:
        raise RunnerError(f"fn and its arguments cannot be pickled with cloudpickle: {exc}") from exc


def run(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
        num_proc: int | None = None, env: dict[str, str] | None = None, start_timeout: float | None = None,
        use_gpu: bool | None = None, max_retries: int = 0, verbose: int = 1, *,
        on_event: Callable[[Event], None] | None = None, spark: Any = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` ranks of one Spark barrier stage and return the results by rank.

    Each rank has ``spark_hvd.core`` initialised (rank = partition id), so Horovod-style code inside ``fn``
    (``hvd.init()``, ``hvd.allreduce(...)``, ``DistributedOptimizer``) runs unchanged. Works on a classic
    SparkSession and on a Spark Connect one (Databricks shared / serverless compute) alike.

    Args:
        fn: the function each rank runs; shipped with cloudpickle, so closures and lambdas work.
        args, kwargs: its arguments (the same on every rank).
        num_proc: number of ranks; defaults to the session's default parallelism. Must not exceed the free task
            slots (checked before launching where the session can tell them: ``NotEnoughSlotsError``).
        env: environment variables set in each rank while ``fn`` runs.
        start_timeout: seconds for every rank to start (``StartTimeoutError`` naming the missing ranks); default
            ``SPARK_HVD_START_TIMEOUT`` or ``HOROVOD_SPARK_START_TIMEOUT`` from the environment, else 600.
        use_gpu: None: pin the GPU Spark assigned to the task (``resources()["gpu"]``) if any; True: also fall
            back to the local rank when Spark assigned none; False: never set ``SPARK_HVD_GPU``.
        max_retries: after a failed attempt, run the whole stage again up to this many times
            (``SPARK_HVD_RUN_ATTEMPT`` tells ``fn`` which attempt it is, e.g. to resume from a checkpoint).
        verbose: 0 silent; 1 ranks' output lines (prefixed ``[rank]``) and rank 0's progress (a progress bar on a
            terminal or in a notebook, a line per epoch otherwise); 2 every report as a line.
        on_event: called on the driver with every ``Event`` reported by ``report(...)`` as it arrives; the events
            of the last run are also kept in ``last_events()``.
        spark: the session to run on; default: this thread's active Spark Connect session, else the active
            classic one.

    Raises:
        RankFailedError: a rank failed (names the rank; remote type, message and traceback), after the retries.
        NotEnoughSlotsError, StartTimeoutError (``StageNotStartedError`` on Connect), RunnerError.
    """
    spark = cluster.active_session(spark)
    start_timeout = _start_timeout(start_timeout)
    if max_retries < 0:
        raise RunnerError(f"max_retries must be >= 0, got {max_retries}")
    env = checked_env(env)
    payload = pickled(fn, tuple(args), dict(kwargs or {}))

    num_proc = resolve_num_proc(spark, num_proc)
    secret = make_secret()
    run_id = secrets.token_hex(4)
    events: list[Event] = []

    def collect_event(event: Event) -> None:
        events.append(event)
        if on_event is not None:
            on_event(event)

    _last_events.clear()
    for attempt in range(max_retries + 1):
        if attempt:
            check_session_slots(spark, num_proc, wait_s=60.0)  # the previous attempt's tasks may be winding down
        try:
            results = _run_attempt(spark, payload, num_proc, env, start_timeout, use_gpu, verbose, secret,
                                   f"{run_id}a{attempt}", attempt, collect_event)
        except (RankFailedError, StartTimeoutError, RunnerError) as exc:
            if isinstance(exc, NotEnoughSlotsError) or attempt >= max_retries:
                _last_events[:] = events
                raise
            logger.warning("spark_hvd run %s attempt %d failed, retrying (%d of %d): %s", run_id, attempt,
                           attempt + 1, max_retries, str(exc).splitlines()[0])
            continue
        _last_events[:] = events
        return results
    raise AssertionError("unreachable")


class _Stage:
    """The barrier stage of one attempt: submitted from its own thread under a job tag (and, on classic, a job
    group, whose running tasks the status tracker can count), cancelled from the watching thread."""

    def __init__(self, spark: Any, job_id: str) -> None:
        self.spark = spark
        self.connect = cluster.is_connect(spark)
        self.tag = f"spark_hvd-{job_id}"

    def collect(self, mapper: Callable, num_proc: int) -> list[tuple[int, bytes]]:
        """Run the stage (in the calling thread); its rows as ``(rank, result bytes)``."""
        self.spark.addTag(self.tag)
        try:
            if not self.connect:
                self.spark.sparkContext.setJobGroup(self.tag, f"spark_hvd run ({num_proc} ranks)",
                                                    interruptOnCancel=True)
            frame = self.spark.range(0, num_proc, 1, num_proc).mapInArrow(mapper, RESULT_SCHEMA, barrier=True)
            return [(int(rank), bytes(result)) for rank, result in frame.collect()]
        finally:
            self.spark.removeTag(self.tag)

    def cancel(self) -> None:
        if self.connect:
            self.spark.interruptTag(self.tag)
        else:
            self.spark.sparkContext.cancelJobGroup(self.tag)

    def wait_gone(self, timeout_s: float) -> None:
        """Wait (bounded) until no task of the stage runs (classic; Connect's interrupt returns once it is done)."""
        if not self.connect:
            _wait_tasks_gone(self.spark.sparkContext, self.tag, timeout_s)


def _run_attempt(spark: Any, payload: bytes, num_proc: int, env: dict[str, str], start_timeout: float,
                 use_gpu: bool | None, verbose: int, secret: bytes, job_id: str, attempt: int,
                 on_event: Callable[[Event], None], handlers: dict[str, Callable] | None = None) -> list[Any]:
    from pyspark import InheritableThread

    stage = _Stage(spark, job_id)
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

    service = DriverService(secret, num_proc, job_id=job_id, verbose=verbose, on_event=on_event,
                            on_failure=cancel, attempt=attempt, handlers=handlers)
    _, port = service.start()
    setup = _TaskSetup(f"{cluster.driver_host(spark)}:{port}", secret, job_id, attempt, num_proc, env, use_gpu,
                       payload, tee=not cluster.is_local_master(spark))
    slots_unknown = stage.connect and cluster.total_slots(spark) is None
    outcome: dict[str, Any] = {}

    def submit() -> None:
        try:
            outcome["results"] = stage.collect(_make_mapper(setup), num_proc)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = exc
        finally:
            service.changed.set()

    # classic: the stage's thread inherits the caller's local properties (job description, pool ...); Connect
    # threads carry nothing but the tag, which collect() sets
    thread_class = threading.Thread if stage.connect else InheritableThread
    thread = thread_class(target=submit, name=f"spark_hvd-run-{job_id}", daemon=True)
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
                raise
            service.changed.clear()
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
        service.wait_finished(10.0, only_started=True)
        stage.wait_gone(TASKS_GONE_WAIT_S)
        root = service.root_failure()
        detail = _spark_message(outcome.get("error"))
        if root is not None:
            raise RankFailedError(root, service.sorted_failures(), detail) from None
        raise RunnerError(f"spark_hvd run {job_id} failed before any rank reported an error: {detail}")
    finally:
        service.stop()


def _wait_tasks_gone(sc: Any, group: str, timeout_s: float) -> bool:
    """Wait (bounded) until no task of the job group is running, so a following run finds its slots free."""
    tracker = sc.statusTracker()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            active = 0
            for job_id in tracker.getJobIdsForGroup(group):
                job = tracker.getJobInfo(job_id)
                for stage_id in (job.stageIds if job else []):
                    stage = tracker.getStageInfo(stage_id)
                    active += stage.numActiveTasks if stage else 0
        except Exception:  # the status tracker is best effort
            logger.debug("spark_hvd: status tracker query failed", exc_info=True)
            return False
        if active == 0:
            return True
        if time.monotonic() > deadline:
            logger.warning("spark_hvd: %d task(s) of job group %s still running %.0f s after the run failed",
                           active, group, timeout_s)
            return False
        threading.Event().wait(0.2)


def _spark_message(exc: BaseException | None, limit: int = 2000) -> str:
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
