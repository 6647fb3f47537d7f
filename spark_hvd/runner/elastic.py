"""``run_elastic(fn, num_proc, min_num_proc, max_num_proc)``: Horovod's elastic training on Spark barrier stages.

A barrier stage cannot lose or gain a task, so each reset is a new stage (an "attempt"):

1. The driver launches ``size`` ranks, ``min_num_proc <= size <= max_num_proc``, as many as there are free task
   slots (the first time at most ``num_proc``), through the runner's ``stage.run_attempt`` (one stage, one driver
   service, the job's secret shared by every attempt).
2. Each rank runs ``fn`` with a ``DriverLink`` installed (``spark_hvd.core.elastic``): ``state.commit()`` on rank 0
   streams the snapshot to the driver service in chunks (authenticated frames; the driver keeps it on its local
   disk, so any size fits) and gets back whether the job can grow; a relaunched rank 0 fetches the last snapshot
   in its first ``state.sync()`` and broadcasts it.
3. A lost rank (its process died, its executor went away, a peer's collective failed as a consequence) fails the
   stage; the driver waits up to ``elastic_timeout`` for ``min_num_proc`` free slots and relaunches. An exception
   raised by ``fn`` itself is, as in Horovod, that worker failing: the driver logs it (rank, host, traceback) and
   relaunches too, until that rank has failed as often as Spark lets one task fail (``spark.task.maxFailures``;
   1 on ``local[N]``, F on ``local[N,F]``) or ``reset_limit`` is reached; then the rank's exception is raised.
4. Growth: while ``size < max_num_proc`` and slots are free, a commit answers "grow"; every rank raises
   ``HostsUpdatedInterrupt`` in the same step, the stage ends cleanly (``Resized`` results) and is relaunched
   bigger.

``reset_limit`` bounds the relaunches (both kinds). Free slots are read from the classic ``SparkContext``. Spark
Connect cannot tell them: there a one-task probe job (``probe.SlotProbe``) that runs while the attempt holds its
slots proves one free, and the job grows by one rank (to ``min(max_num_proc, N)`` on a ``local[N]`` master, whose
total is known); a relaunch after a lost rank takes ``min(max_num_proc, N)``, or ``max_num_proc`` where the total
is unknown.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from spark_hvd.core.elastic import HostsUpdatedInterrupt, set_link, state_max_bytes
from spark_hvd.core.transport.wire import make_secret
from spark_hvd.runner import cluster
from spark_hvd.runner.client import Event, ServiceClient, current_client
from spark_hvd.runner.errors import CONSEQUENCE_TYPES, RankFailedError, RunnerError, StartTimeoutError
from spark_hvd.runner.horovod_kwargs import OutputStreams, horovod_env, np_alias
from spark_hvd.runner.probe import SlotProbe
from spark_hvd.runner.script import as_callable
from spark_hvd.runner.slots import free_slots, free_slots_beside
from spark_hvd.runner.spark import EventLog, checked_env, env_seconds, job_encrypts, pickled, start_timeout_s
from spark_hvd.runner.stage import Attempt, run_attempt, stage_tag

logger = logging.getLogger(__name__)

#: Environment fallback of ``run_elastic(elastic_timeout=...)`` (Horovod's name).
ELASTIC_TIMEOUT_ENV = "HOROVOD_ELASTIC_TIMEOUT"
#: Seconds the answer to "can the job grow?" is reused (one status-tracker query per second at most).
GROW_CHECK_S = 1.0


class ElasticError(RunnerError):
    """An elastic run could not go on: too few slots within ``elastic_timeout``, or ``reset_limit`` reached."""


@dataclass(frozen=True)
class Resized:
    """What a rank returns when the ranks agreed to stop for a relaunch at a bigger size."""

    size: int


class _ServiceLink:
    """The rank side of ``DriverLink`` over the rank's connection to the driver service."""

    def __init__(self, client: ServiceClient) -> None:
        self.client = client

    def put(self, commit_id: str, seq: int, data: bytes) -> None:
        self.client.request("elastic.put", (commit_id, seq, data))

    def commit(self, commit_id: str, sizes: list[int]) -> bool:
        return bool(self.client.request("elastic.commit", (commit_id, list(sizes))))

    def committed(self) -> list[int] | None:
        return self.client.request("elastic.fetch")

    def get(self, offset: int, nbytes: int) -> bytes:
        return self.client.request("elastic.get", (offset, nbytes))

    def hosts_updated(self) -> bool:
        return bool(self.client.request("elastic.hosts"))


def elastic_rank(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    """Runs in each rank: ``fn`` with the driver link installed; a resize becomes a clean ``Resized`` result."""
    import spark_hvd.core as core

    client = current_client()
    if client is None:
        raise RunnerError("run_elastic: this rank has no connection to the driver service")
    set_link(_ServiceLink(client))
    try:
        return fn(*args, **kwargs)
    except HostsUpdatedInterrupt:
        return Resized(core.size())
    finally:
        set_link(None)


class ElasticDriver:
    """The driver's elastic state across attempts: the last committed snapshot and the growth check.

    The snapshot is kept in a private temporary directory on the driver's disk (``committed`` and the ``pending``
    upload; ``close()`` removes it), never whole in memory: its size is bounded by the disk, not the heap.
    """

    def __init__(self, spark: Any, max_num_proc: int, run_id: str = "") -> None:
        self.spark = spark
        self.max_num_proc = max_num_proc
        #: Connect: the probe that tells whether a slot is free (classic sessions ask the scheduler)
        self.probe = SlotProbe(spark, f"spark_hvd-{run_id}-probe") if cluster.is_connect(spark) else None
        self.size = 0
        #: the job group of the running attempt's stage
        self.group = ""
        self.commits = 0
        self._dir = tempfile.mkdtemp(prefix="spark_hvd_elastic_")
        self._pending_id: str | None = None
        self._pending_seq = 0
        self._pending_bytes = 0
        self._sizes: list[int] | None = None
        self._lock = threading.Lock()
        self._grow_at = 0.0
        self._grow = False

    def handlers(self) -> dict[str, Callable[[int, Any], Any]]:
        return {"elastic.put": self._put, "elastic.commit": self._commit, "elastic.fetch": self._fetch,
                "elastic.get": self._get, "elastic.hosts": self._hosts}

    def close(self) -> None:
        """Remove the committed state from the driver's disk; stop a slot probe still running."""
        if self.probe is not None:
            self.probe.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _path(self, name: str) -> str:
        return os.path.join(self._dir, name)

    @staticmethod
    def _only_rank0(rank: int) -> None:
        if rank != 0:
            raise ValueError(f"only rank 0 commits the elastic state, not rank {rank}")

    def _put(self, rank: int, payload: Any) -> None:
        self._only_rank0(rank)
        commit_id, seq, data = payload
        if not isinstance(commit_id, str) or not isinstance(seq, int) or not isinstance(data, bytes):
            raise ValueError("elastic.put takes (commit id, chunk number, bytes)")
        cap = state_max_bytes()
        with self._lock:
            if seq == 0:  # a new upload replaces an unfinished one (its rank was lost mid-upload)
                self._pending_id, self._pending_seq, self._pending_bytes = commit_id, 0, 0
            if commit_id != self._pending_id or seq != self._pending_seq:
                raise ValueError(f"elastic.put: chunk {seq} of commit {commit_id} is out of order")
            if cap is not None and self._pending_bytes + len(data) > cap:
                raise ValueError(f"the committed state is above SPARK_HVD_ELASTIC_STATE_MAX={cap} bytes")
            with open(self._path("pending"), "wb" if seq == 0 else "ab") as f:
                f.write(data)
            self._pending_seq += 1
            self._pending_bytes += len(data)

    def _commit(self, rank: int, payload: Any) -> bool:
        self._only_rank0(rank)
        commit_id, sizes = payload
        if not isinstance(sizes, list) or not all(isinstance(n, int) and n >= 0 for n in sizes) or not sizes:
            raise ValueError("elastic.commit takes (commit id, list of part sizes)")
        with self._lock:
            if commit_id != self._pending_id or sum(sizes) != self._pending_bytes:
                raise ValueError(f"elastic.commit: commit {commit_id} was not uploaded whole "
                                 f"({self._pending_bytes} bytes received, {sum(sizes)} announced)")
            os.replace(self._path("pending"), self._path("committed"))
            self._sizes, self._pending_id = list(sizes), None
            self.commits += 1
        return self._hosts(rank, None)

    def _fetch(self, rank: int, _: Any) -> list[int] | None:
        with self._lock:
            return None if self._sizes is None else list(self._sizes)

    def _get(self, rank: int, payload: Any) -> bytes:
        offset, nbytes = payload
        if not isinstance(offset, int) or not isinstance(nbytes, int) or offset < 0 or not 0 < nbytes <= 64 << 20:
            raise ValueError("elastic.get takes (offset, 1 to 64 MiB)")
        with self._lock:
            if self._sizes is None:
                raise ValueError("elastic.get: nothing is committed")
            with open(self._path("committed"), "rb") as f:
                f.seek(offset)
                return f.read(nbytes)

    def _hosts(self, rank: int, _: Any) -> bool:
        if self.probe is not None:  # Connect cannot tell free slots: a probe job proves one
            return self.size < self.max_num_proc and self.probe.free()
        now = time.monotonic()
        with self._lock:
            if now - self._grow_at < GROW_CHECK_S:
                return self._grow
        try:  # the running attempt's own tasks are ``size``, whether or not the status tracker counts them yet
            free = free_slots_beside(self.spark.sparkContext, self.group, self.size)
        except Exception:  # the status tracker is best effort: no growth this time
            logger.debug("spark_hvd: free slot query failed", exc_info=True)
            free = 0
        grow = self.size < self.max_num_proc and free > 0
        with self._lock:
            self._grow, self._grow_at = grow, now
        return grow


def _wait_slots(spark: Any, low: int, high: int, timeout_s: float, why: str) -> int:
    """``min(high, free slots)`` once at least ``low`` are free; ``ElasticError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        free = free_slots(spark, high)
        if free >= low:
            return min(high, free)
        if time.monotonic() > deadline:
            raise ElasticError(
                f"run_elastic {why}: min_num_proc={low} free task slots are needed but only {free} became free "
                f"within elastic_timeout={timeout_s:g} s ({low - free} missing); free or add executors/cores, or "
                f"lower min_num_proc")
        threading.Event().wait(0.5)


def is_recoverable(exc: RankFailedError) -> bool:
    """A lost rank or a failure caused by one (not an exception raised by ``fn`` itself: ``OwnFailures``)."""
    root = exc.failures[0] if exc.failures else None
    return root is None or root.kind == "lost" or root.type_name in CONSEQUENCE_TYPES


class OwnFailures:
    """Exceptions raised by ``fn`` itself, counted per rank: as in Horovod, such a rank is a failed worker and the
    job is relaunched from the last commit, until Spark's limit of failures of one task (``task_max_failures``:
    1 on ``local[N]``, F on ``local[N,F]``, else ``spark.task.maxFailures``) or ``reset_limit`` is reached; then
    the rank's exception itself is raised."""

    def __init__(self, max_failures: int, reset_limit: int | None, run_id: str) -> None:
        self.max_failures = max_failures
        self.reset_limit = reset_limit
        self.run_id = run_id
        self.by_rank: dict[int, int] = {}

    def count(self, exc: RankFailedError, resets: int) -> None:
        """Log the rank's exception (rank, host, traceback) and raise ``exc`` when no relaunch is left for it."""
        root = exc.failures[0]
        failures = self.by_rank[root.rank] = self.by_rank.get(root.rank, 0) + 1
        host = f" on host {root.host}" if root.host else ""
        last = failures >= self.max_failures or (self.reset_limit is not None and resets >= self.reset_limit)
        limit = (f"Spark's limit of {self.max_failures} failures of one task" if failures >= self.max_failures
                 else f"reset_limit={self.reset_limit}")
        then = f"{limit} is reached: the run fails" if last else "relaunching from the last commit"
        logger.warning("spark_hvd run_elastic %s: rank %d%s raised %s: %s (its failure %d; %s)\n%s", self.run_id,
                       root.rank, host, root.type_name, root.message, failures, then, root.traceback.rstrip())
        if last:
            raise exc


def elastic_timeout_s(value: float | None) -> float:
    """How long an elastic job waits for its minimum size: ``value``, else ``HOROVOD_ELASTIC_TIMEOUT``, else 600 s;
    a non-positive value is a ``RunnerError``."""
    seconds = float(value) if value is not None else env_seconds((ELASTIC_TIMEOUT_ENV,), 600.0)
    if seconds <= 0:
        raise RunnerError(f"elastic_timeout must be a positive number of seconds, got {seconds:g}")
    return seconds


def _sizes(spark: Any, num_proc: int | None, min_num_proc: int | None,
           max_num_proc: int | None) -> tuple[int, int, int]:
    num_proc = cluster.default_parallelism(spark) if num_proc is None else num_proc
    low = num_proc if min_num_proc is None else min_num_proc
    high = num_proc if max_num_proc is None else max_num_proc
    for name, value in (("num_proc", num_proc), ("min_num_proc", low), ("max_num_proc", high)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise RunnerError(f"{name} must be a positive integer, got {value!r}")
    if low > high:
        raise RunnerError(f"min_num_proc={low} is above max_num_proc={high}")
    return max(low, min(num_proc, high)), low, high


def run_elastic(fn: Callable[..., Any] | str | os.PathLike, args: Sequence[Any] = (),
                kwargs: dict[str, Any] | None = None,
                num_proc: int | None = None, min_num_proc: int | None = None, max_num_proc: int | None = None,
                start_timeout: float | None = None, elastic_timeout: float | None = None,
                reset_limit: int | None = None, env: dict[str, str] | None = None, verbose: int = 1, *,
                use_gpu: bool | None = None, on_event: Callable[[Event], None] | None = None,
                spark: Any = None, encrypt: bool | None = None, stdout: TextIO | None = None,
                stderr: TextIO | None = None, prefix_output_with_timestamp: bool = False,
                nics: Iterable[str] | None = None, min_np: int | None = None, max_np: int | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` as an elastic job on Spark and return the results of its last attempt by rank.

    ``fn`` uses Horovod's elastic API (``hvd.elastic.run``, ``TorchState`` / ``KerasState``, ``state.commit()``).
    When a rank is lost the job is relaunched with the free task slots and resumes from the last commit; when
    slots free up below ``max_num_proc`` the ranks stop at their next commit and the job is relaunched bigger.

    Args:
        fn, args, kwargs: as for ``run`` (a script too: it uses ``hvd.elastic.run`` itself, and a relaunch runs it
            again from the top, its state restored from the last commit).
        num_proc: ranks of the first launch (default: the session's default parallelism); fewer when fewer slots
            are free, but at least ``min_num_proc``.
        min_num_proc: the fewest ranks training goes on with (default ``num_proc``).
        max_num_proc: the most ranks (default ``num_proc``).
        start_timeout: seconds for the ranks of each launch to start (as for ``run``).
        elastic_timeout: seconds to wait for ``min_num_proc`` free slots before a launch (default
            ``HOROVOD_ELASTIC_TIMEOUT``, else 600); ``ElasticError`` names how many were missing.
        reset_limit: the most relaunches (after lost ranks, exceptions of ``fn`` or to grow); None: no limit but
            Spark's per-task failure limit for the exceptions of ``fn`` (module docstring).
        env, verbose, use_gpu, on_event, spark, encrypt: as for ``run``.
        stdout, stderr, prefix_output_with_timestamp, nics: Horovod's, as for ``run``.
        min_np, max_np: Horovod's deprecated names of ``min_num_proc``, ``max_num_proc``.

    Raises:
        ElasticError: too few slots within ``elastic_timeout``, or more resets than ``reset_limit``.
        RankFailedError: ``fn`` raised an exception of its own (not a lost rank) once too often: the last one,
            naming its rank.
    """
    min_num_proc = np_alias(min_num_proc, min_np, "min_num_proc", "min_np")
    max_num_proc = np_alias(max_num_proc, max_np, "max_num_proc", "max_np")
    env = horovod_env(env, nics=nics, what="run_elastic")
    output = OutputStreams(stdout, stderr, prefix_output_with_timestamp)
    spark = cluster.active_session(spark)
    start_s = start_timeout_s(start_timeout)
    elastic_s = elastic_timeout_s(elastic_timeout)
    if reset_limit is not None and reset_limit < 0:
        raise RunnerError(f"reset_limit must be >= 0 or None, got {reset_limit}")
    first, low, high = _sizes(spark, num_proc, min_num_proc, max_num_proc)
    env = checked_env(env)
    encrypted = job_encrypts(encrypt, env)
    payload = pickled(elastic_rank, as_callable(fn, args, kwargs), {})
    secret, run_id = make_secret(), secrets.token_hex(4)
    driver = ElasticDriver(spark, high, run_id)
    events = EventLog(on_event)

    resets = 0
    own = OwnFailures(cluster.task_max_failures(spark), reset_limit, run_id)
    try:
        size = _wait_slots(spark, low, first, elastic_s, "could not start")
        for attempt in range(1 << 30):
            driver.size, driver.group = size, stage_tag(f"{run_id}a{attempt}")
            logger.info("spark_hvd run_elastic %s: attempt %d with %d ranks", run_id, attempt, size)
            try:
                stage = Attempt(payload, size, secret, f"{run_id}a{attempt}", attempt, env, start_s, use_gpu, verbose,
                                encrypt=encrypted, output=output)
                results = run_attempt(spark, stage, events, driver.handlers())
                why = "" if not any(isinstance(r, Resized) for r in results) else "to grow"
            except RankFailedError as exc:
                if not is_recoverable(exc):
                    own.count(exc, resets)  # raises it when Spark's task failures or reset_limit are used up
                why = f"after {str(exc).splitlines()[0]}"
            except StartTimeoutError as exc:
                why = f"after {exc}"
            if not why:
                return results
            resets += 1
            if reset_limit is not None and resets > reset_limit:
                raise ElasticError(f"run_elastic {run_id}: reset_limit={reset_limit} reached; the last reset was "
                                   f"needed {why}")
            logger.warning("spark_hvd run_elastic %s: relaunching (reset %d) %s", run_id, resets, why)
            # Connect to a cluster of unknown size: the probe proved one free slot, so grow by one
            most = size + 1 if why == "to grow" and driver.probe is not None and cluster.total_slots(spark) is None \
                else high
            size = _wait_slots(spark, low, min(most, high), elastic_s, f"reset {resets} ({why})")
        raise AssertionError("unreachable")
    finally:
        driver.close()
        events.publish()
