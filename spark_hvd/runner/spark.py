"""``run(fn, num_proc)``: one Spark barrier stage of ``num_proc`` tasks, each a rank of a spark_hvd job.

The driver checks the free task slots (``slots``), creates a per-job secret and runs one attempt (``stage``: the
barrier stage and its driver service; ``barrier_task``: what each task does), again up to ``max_retries`` times
after a failure. ``run_checked`` is the same for a caller that resolved ``num_proc`` and checked its slots itself
(the estimators' ``SparkBackend``, which does it once per fit before preparing the data).
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TextIO

from spark_hvd import pickling
from spark_hvd.core.jobenv import ENCRYPT, encrypt_requested
from spark_hvd.core.transport.wire import make_secret
from spark_hvd.runner import cluster
from spark_hvd.runner.client import Event
from spark_hvd.runner.errors import NotEnoughSlotsError, RankFailedError, RunnerError, StartTimeoutError
from spark_hvd.runner.horovod_kwargs import OutputStreams, horovod_env
from spark_hvd.runner.script import as_callable
from spark_hvd.runner.slot_ledger import LEDGER
from spark_hvd.runner.slots import check_session_slots, resolve_num_proc, session_key, session_total_slots
from spark_hvd.runner.stage import Attempt, run_attempt

__all__ = ["run", "run_checked", "last_events", "EventLog", "env_seconds", "start_timeout_s", "slot_wait_s",
           "checked_env", "pickled"]

logger = logging.getLogger(__name__)

#: Environment fallback of ``run(start_timeout=...)`` (Horovod's name).
START_TIMEOUT_ENV = "HOROVOD_SPARK_START_TIMEOUT"

_last_events: list[Event] = []


def last_events() -> list[Event]:
    """The progress events (``report(...)``) of the last ``run`` in this driver process, in arrival order."""
    return list(_last_events)


class EventLog:
    """The events of one run: each handed to ``on_event`` as it arrives and kept; ``publish()`` makes them
    ``last_events()``."""

    def __init__(self, on_event: Callable[[Event], None] | None = None) -> None:
        self.events: list[Event] = []
        self.on_event = on_event

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)

    def publish(self) -> None:
        _last_events[:] = self.events


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


def start_timeout_s(value: float | None) -> float:
    """``start_timeout`` as given, else ``SPARK_HVD_START_TIMEOUT`` / ``HOROVOD_SPARK_START_TIMEOUT``, else 600."""
    if value is not None:
        return float(value)
    return env_seconds(("SPARK_HVD_START_TIMEOUT", START_TIMEOUT_ENV), 600.0)


def slot_wait_s(spark: Any, start_timeout: float | None) -> float | None:
    """How long ``run`` waits for ``num_proc`` free task slots before it launches: ``start_timeout`` (Horovod waits
    that long for the Spark tasks to start; a cluster may add executors). On ``local[N]``, whose total never grows,
    only a ``start_timeout`` given (argument or environment) is waited; else None: the check fails at once."""
    given = start_timeout is not None or any(os.environ.get(n) for n in ("SPARK_HVD_START_TIMEOUT", START_TIMEOUT_ENV))
    if cluster.is_local_master(spark) and not given:
        return None
    return start_timeout_s(start_timeout)


def checked_env(env: dict[str, str] | None) -> dict[str, str]:
    """A copy of ``env``; ``RunnerError`` unless it maps str to str."""
    env = dict(env or {})
    for key, value in env.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise RunnerError(f"env must map str to str; {key!r}: {value!r} is not")
    return env


def job_encrypts(encrypt: bool | None, env: dict[str, str]) -> bool:
    """``run(encrypt=...)`` as given, else ``SPARK_HVD_ENCRYPT`` of ``env`` (the ranks' extra environment) or of the
    driver's; written into ``env`` as 1 or 0, so that every rank and the driver's service see the same."""
    if encrypt is None:
        encrypt = encrypt_requested({**os.environ, **env})
    env[ENCRYPT] = "1" if encrypt else "0"
    return bool(encrypt)


def pickled(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> bytes:
    """``(fn, args, kwargs)`` pickled for the tasks (``spark_hvd.pickling``: code shipped by value keeps its source
    lines); ``RunnerError`` when they cannot be."""
    try:
        return pickling.dumps((fn, args, kwargs))
    except Exception as exc:
        raise RunnerError(f"fn and its arguments cannot be pickled with cloudpickle: {exc}") from exc


def run(fn: Callable[..., Any] | str | os.PathLike, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
        num_proc: int | None = None, env: dict[str, str] | None = None, start_timeout: float | None = None,
        use_gpu: bool | None = None, max_retries: int = 0, verbose: int = 1, *,
        on_event: Callable[[Event], None] | None = None, spark: Any = None, encrypt: bool | None = None,
        stdout: TextIO | None = None, stderr: TextIO | None = None, prefix_output_with_timestamp: bool = False,
        nics: Iterable[str] | None = None, use_gloo: bool | None = None, use_mpi: bool | None = None,
        extra_mpi_args: str | None = None, executable: str | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` (or a script) on ``num_proc`` ranks of one Spark barrier stage; the results by rank.

    Each rank has ``spark_hvd.core`` initialised (rank = partition id), so Horovod-style code inside ``fn``
    (``hvd.init()``, ``hvd.allreduce(...)``, ``DistributedOptimizer``) runs unchanged. Works on a classic
    SparkSession and on a Spark Connect one (Databricks shared / serverless compute) alike.

    Every rank also gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ...),
    and an unmodified ``torch.distributed.init_process_group()`` meets over the job's authenticated store
    (``spark_hvd.core.torchrun``), so DDP / FSDP / Lightning / Hugging Face code runs unchanged.

    Args:
        fn: the function each rank runs; shipped with cloudpickle, so closures and lambdas work. Or the path of a
            Python script, run as ``__main__`` on every rank with ``sys.argv = [path, *args]``
            (``spark_hvd.runner.script``); its result is 0 and a non-zero exit status fails the run
            (``RankFailedError.exit_code``).
        args, kwargs: its arguments (the same on every rank); for a script, ``args`` are its command-line
            arguments (strings) and there are no kwargs.
        num_proc: number of ranks; defaults to the session's default parallelism. Must not exceed the free task
            slots, checked before launching where the session can tell them: with too few, ``run`` waits up to
            ``start_timeout`` for executors to be added or slots to be given back (as Horovod waits for its tasks
            to start), then raises ``SlotsTimeoutError`` ("Timed out waiting for Spark tasks to start", a
            ``NotEnoughSlotsError`` and a ``TimeoutError``); on ``local[N]``, whose slots never grow,
            ``NotEnoughSlotsError`` at once unless ``start_timeout`` is given.
        env: environment variables set in each rank while ``fn`` runs.
        start_timeout: seconds for enough task slots to be free (see ``num_proc``), then for every rank to start
            (``StartTimeoutError`` naming the missing ranks); default ``SPARK_HVD_START_TIMEOUT`` or
            ``HOROVOD_SPARK_START_TIMEOUT`` from the environment, else 600.
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
        encrypt: encrypt every frame between the ranks and with the driver's service (AES-256-GCM; shared memory
            within a host is unchanged; docs/reliability.md); None: ``SPARK_HVD_ENCRYPT`` of ``env`` or of the
            driver's environment, else off.
        stdout, stderr: Horovod's: streams the ranks' output lines go to, as ``[rank]<stdout>:line`` (whatever
            ``verbose`` says); ``prefix_output_with_timestamp`` starts each forwarded line with the time.
        nics: Horovod's: the network interfaces the ranks use (``SPARK_HVD_NETWORK_INTERFACE``).
        use_gloo, use_mpi, extra_mpi_args, executable: Horovod's launch choices: ``use_gloo`` True or None is
            the built-in ring; ``use_mpi=True``, ``extra_mpi_args`` and ``executable`` are refused with what to
            write instead (``spark_hvd.runner.horovod_kwargs``).

    Raises:
        RankFailedError: a rank failed (names the rank; remote type, message and traceback), after the retries.
        NotEnoughSlotsError (``SlotsTimeoutError`` after waiting), StartTimeoutError (``StageNotStartedError`` on
        Connect), RunnerError.
    """
    env = horovod_env(env, use_mpi=use_mpi, use_gloo=use_gloo, extra_mpi_args=extra_mpi_args, nics=nics,
                      executable=executable)
    spark = cluster.active_session(spark)
    launch = _Launch(fn, args, kwargs, env, start_timeout, max_retries, encrypt,
                     OutputStreams(stdout, stderr, prefix_output_with_timestamp))
    return launch.run(spark, resolve_num_proc(spark, num_proc, slot_wait_s(spark, start_timeout)), use_gpu, verbose,
                      on_event)


def run_checked(spark: Any, num_proc: int, fn: Callable[..., Any] | str | os.PathLike, args: Sequence[Any] = (),
                kwargs: dict[str, Any] | None = None, *, env: dict[str, str] | None = None,
                start_timeout: float | None = None, use_gpu: bool | None = None, max_retries: int = 0,
                verbose: int = 1, on_event: Callable[[Event], None] | None = None,
                encrypt: bool | None = None) -> list[Any]:
    """``run`` on ``spark`` with ``num_proc`` as ``resolve_num_proc`` returned it: its slots are not checked again
    (a retry still waits for the previous attempt's tasks to leave theirs)."""
    launch = _Launch(fn, args, kwargs, env, start_timeout, max_retries, encrypt)
    return launch.run(spark, num_proc, use_gpu, verbose, on_event)


class _Launch:
    """``run``'s arguments checked (before any slot check or Spark job; ``fn`` is checked and pickled when the
    attempts start, after the slot check, as Horovod's ``run(None, ...)`` with too few slots times out), and its
    loop of attempts."""

    def __init__(self, fn: Callable[..., Any] | str | os.PathLike, args: Sequence[Any], kwargs: dict[str, Any] | None,
                 env: dict[str, str] | None, start_timeout: float | None, max_retries: int,
                 encrypt: bool | None = None, output: OutputStreams | None = None) -> None:
        self.start_timeout = start_timeout_s(start_timeout)
        self.output = output
        if max_retries < 0:
            raise RunnerError(f"max_retries must be >= 0, got {max_retries}")
        self.max_retries = max_retries
        self.env = checked_env(env)
        self.encrypt = job_encrypts(encrypt, self.env)
        self.call = (fn, args, kwargs)

    def run(self, spark: Any, num_proc: int, use_gpu: bool | None, verbose: int,
            on_event: Callable[[Event], None] | None) -> list[Any]:
        """The attempts, holding ``num_proc`` of the session's slots (``slot_ledger``: concurrent runs of this
        process wait their turn instead of failing or oversubscribing)."""
        self.payload = pickled(*as_callable(*self.call))
        run_id = secrets.token_hex(4)
        total = session_total_slots(spark)
        if total is None:  # a Connect session that cannot tell its slots: the stage itself is the check
            return self._attempts(spark, num_proc, use_gpu, verbose, on_event, run_id)
        with LEDGER.reserve(session_key(spark), num_proc, total, what=f"run {run_id}"):
            return self._attempts(spark, num_proc, use_gpu, verbose, on_event, run_id)

    def _attempts(self, spark: Any, num_proc: int, use_gpu: bool | None, verbose: int,
                  on_event: Callable[[Event], None] | None, run_id: str) -> list[Any]:
        secret = make_secret()
        events = EventLog(on_event)
        _last_events.clear()
        for attempt in range(self.max_retries + 1):
            if attempt:
                check_session_slots(spark, num_proc, wait_s=60.0)  # the previous attempt's tasks may be winding down
            try:
                results = run_attempt(spark, Attempt(self.payload, num_proc, secret, f"{run_id}a{attempt}", attempt,
                                                     self.env, self.start_timeout, use_gpu, verbose,
                                                     encrypt=self.encrypt, output=self.output), events)
            except (RankFailedError, StartTimeoutError, RunnerError) as exc:
                if isinstance(exc, NotEnoughSlotsError) or attempt >= self.max_retries:
                    events.publish()
                    raise
                logger.warning("spark_hvd run %s attempt %d failed, retrying (%d of %d): %s", run_id, attempt,
                               attempt + 1, self.max_retries, str(exc).splitlines()[0])
                continue
            events.publish()
            return results
        raise AssertionError("unreachable")
