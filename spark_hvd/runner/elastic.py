"""``run_elastic(fn, num_proc, min_num_proc, max_num_proc)``: Horovod's elastic training on Spark barrier stages.

A barrier stage cannot lose or gain a task, so each reset is a new stage (an "attempt"):

1. The driver launches ``size`` ranks, ``min_num_proc <= size <= max_num_proc``, as many as there are free task
   slots (the first time at most ``num_proc``), through the runner's ``_run_attempt`` (one stage, one driver
   service, the job's secret shared by every attempt).
2. Each rank runs ``fn`` with a ``DriverLink`` installed (``spark_hvd.core.elastic``): ``state.commit()`` on rank 0
   sends the pickled snapshot to the driver service (authenticated frames, size-capped) and gets back whether the
   job can grow; a relaunched rank 0 fetches the last snapshot in its first ``state.sync()`` and broadcasts it.
3. A lost rank (its process died, its executor went away, a peer's collective failed as a consequence) fails the
   stage; the driver waits up to ``elastic_timeout`` for ``min_num_proc`` free slots and relaunches. An exception
   raised by ``fn`` itself is a bug, not a lost rank: it fails the run as ``run()`` does.
4. Growth: while ``size < max_num_proc`` and slots are free, a commit answers "grow"; every rank raises
   ``HostsUpdatedInterrupt`` in the same step, the stage ends cleanly (``_Resized`` results) and is relaunched
   bigger.

``reset_limit`` bounds the relaunches (both kinds). Free slots are read from the classic ``SparkContext``; over
Spark Connect only a ``local[N]`` master tells its total, so there the job never grows and relaunches at
``min(max_num_proc, N)``.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from spark_hvd.core.elastic import HostsUpdatedInterrupt, set_link, state_max_bytes
from spark_hvd.core.wire import make_secret
from spark_hvd.runner import cluster
from spark_hvd.runner import service as _service
from spark_hvd.runner import spark as _spark
from spark_hvd.runner.errors import CONSEQUENCE_TYPES, RankFailedError, RunnerError, StartTimeoutError
from spark_hvd.runner.service import Event, ServiceClient

logger = logging.getLogger(__name__)

#: Environment fallback of ``run_elastic(elastic_timeout=...)`` (Horovod's name).
ELASTIC_TIMEOUT_ENV = "HOROVOD_ELASTIC_TIMEOUT"
#: Seconds the answer to "can the job grow?" is reused (one status-tracker query per second at most).
GROW_CHECK_S = 1.0


class ElasticError(RunnerError):
    """An elastic run could not go on: too few slots within ``elastic_timeout``, or ``reset_limit`` reached."""


@dataclass(frozen=True)
class _Resized:
    """What a rank returns when the ranks agreed to stop for a relaunch at a bigger size."""

    size: int


class _ServiceLink:
    """The rank side of ``DriverLink`` over the rank's connection to the driver service."""

    def __init__(self, client: ServiceClient) -> None:
        self.client = client

    def commit(self, blob: bytes) -> bool:
        return bool(self.client.request("elastic.commit", blob))

    def committed(self) -> bytes | None:
        return self.client.request("elastic.fetch")

    def hosts_updated(self) -> bool:
        return bool(self.client.request("elastic.hosts"))


def _elastic_rank(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    """Runs in each rank: ``fn`` with the driver link installed; a resize becomes a clean ``_Resized`` result."""
    import spark_hvd.core as core

    client = _service._get_client()
    if client is None:
        raise RunnerError("run_elastic: this rank has no connection to the driver service")
    set_link(_ServiceLink(client))
    try:
        return fn(*args, **kwargs)
    except HostsUpdatedInterrupt:
        return _Resized(core.size())
    finally:
        set_link(None)


class _Driver:
    """The driver's elastic state across attempts: the last committed snapshot and the growth check."""

    def __init__(self, spark: Any, max_num_proc: int) -> None:
        self.spark = spark
        self.max_num_proc = max_num_proc
        self.size = 0
        self._blob: bytes | None = None
        self.commits = 0
        self._lock = threading.Lock()
        self._grow_at = 0.0
        self._grow = False

    def handlers(self) -> dict[str, Callable[[int, Any], Any]]:
        return {"elastic.commit": self._commit, "elastic.fetch": self._fetch, "elastic.hosts": self._hosts}

    def _commit(self, rank: int, blob: Any) -> bool:
        if rank != 0:
            raise ValueError(f"only rank 0 commits the elastic state, not rank {rank}")
        if not isinstance(blob, bytes) or len(blob) > state_max_bytes():
            raise ValueError("the committed state must be bytes of at most SPARK_HVD_ELASTIC_STATE_MAX")
        with self._lock:
            self._blob = blob
            self.commits += 1
        return self._hosts(rank, None)

    def _fetch(self, rank: int, _: Any) -> bytes | None:
        with self._lock:
            return self._blob

    def _hosts(self, rank: int, _: Any) -> bool:
        if cluster.is_connect(self.spark):
            return False  # Connect cannot tell free slots (only a local master's total): never grow there
        now = time.monotonic()
        with self._lock:
            if now - self._grow_at < GROW_CHECK_S:
                return self._grow
        grow = self.size < self.max_num_proc and (free_slots(self.spark, self.max_num_proc) or 0) > 0
        with self._lock:
            self._grow, self._grow_at = grow, now
        return grow


def free_slots(spark: Any, unknown: int) -> int:
    """Free task slots now: classic from the status tracker; Connect the ``local[N]`` total, else ``unknown``."""
    if not cluster.is_connect(spark):
        return _spark._slots(spark.sparkContext)[0]
    total = cluster.total_slots(spark)
    return unknown if total is None else total


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


def _recoverable(exc: RankFailedError) -> bool:
    """A lost rank or a failure caused by one (not an exception raised by ``fn`` itself)."""
    root = exc.failures[0] if exc.failures else None
    return root is None or root.kind == "lost" or root.type_name in CONSEQUENCE_TYPES


def _timeout(value: float | None) -> float:
    seconds = float(value) if value is not None else _spark.env_seconds((ELASTIC_TIMEOUT_ENV,), 600.0)
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


def run_elastic(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
                num_proc: int | None = None, min_num_proc: int | None = None, max_num_proc: int | None = None,
                start_timeout: float | None = None, elastic_timeout: float | None = None,
                reset_limit: int | None = None, env: dict[str, str] | None = None, verbose: int = 1, *,
                use_gpu: bool | None = None, on_event: Callable[[Event], None] | None = None,
                spark: Any = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` as an elastic job on Spark and return the results of its last attempt by rank.

    ``fn`` uses Horovod's elastic API (``hvd.elastic.run``, ``TorchState`` / ``KerasState``, ``state.commit()``).
    When a rank is lost the job is relaunched with the free task slots and resumes from the last commit; when
    slots free up below ``max_num_proc`` the ranks stop at their next commit and the job is relaunched bigger.

    Args:
        fn, args, kwargs: as for ``run``.
        num_proc: ranks of the first launch (default: the session's default parallelism); fewer when fewer slots
            are free, but at least ``min_num_proc``.
        min_num_proc: the fewest ranks training goes on with (default ``num_proc``).
        max_num_proc: the most ranks (default ``num_proc``).
        start_timeout: seconds for the ranks of each launch to start (as for ``run``).
        elastic_timeout: seconds to wait for ``min_num_proc`` free slots before a launch (default
            ``HOROVOD_ELASTIC_TIMEOUT``, else 600); ``ElasticError`` names how many were missing.
        reset_limit: the most relaunches (after lost ranks or to grow); None: no limit.
        env, verbose, use_gpu, on_event, spark: as for ``run``.

    Raises:
        ElasticError: too few slots within ``elastic_timeout``, or more resets than ``reset_limit``.
        RankFailedError: ``fn`` raised an exception of its own (not a lost rank).
    """
    spark = cluster.active_session(spark)
    start_s = _spark._start_timeout(start_timeout)
    elastic_s = _timeout(elastic_timeout)
    if reset_limit is not None and reset_limit < 0:
        raise RunnerError(f"reset_limit must be >= 0 or None, got {reset_limit}")
    first, low, high = _sizes(spark, num_proc, min_num_proc, max_num_proc)
    env = _spark.checked_env(env)
    payload = _spark.pickled(_elastic_rank, (fn, tuple(args), dict(kwargs or {})), {})
    driver = _Driver(spark, high)
    secret, run_id = make_secret(), secrets.token_hex(4)
    events: list[Event] = []

    def collect_event(event: Event) -> None:
        events.append(event)
        if on_event is not None:
            on_event(event)

    size = _wait_slots(spark, low, first, elastic_s, "could not start")
    resets = 0
    try:
        for attempt in range(1 << 30):
            driver.size = size
            logger.info("spark_hvd run_elastic %s: attempt %d with %d ranks", run_id, attempt, size)
            try:
                results = _spark._run_attempt(spark, payload, size, env, start_s, use_gpu, verbose, secret,
                                              f"{run_id}a{attempt}", attempt, collect_event, driver.handlers())
                why = "" if not any(isinstance(r, _Resized) for r in results) else "to grow"
            except RankFailedError as exc:
                if not _recoverable(exc):
                    raise
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
            size = _wait_slots(spark, low, high, elastic_s, f"reset {resets} ({why})")
        raise AssertionError("unreachable")
    finally:
        _spark._last_events[:] = events
