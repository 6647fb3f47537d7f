"""``SparkBackend``: the one way the estimators reach the runner (Horovod's ``backend`` of its Spark estimators).

An estimator builds one per ``fit``: ``num_processes()`` resolves ``num_proc`` and checks its free task slots (once,
before any data is prepared), and ``run(fn, args)`` launches the barrier stage on those processes without checking
them again (``spark.run_checked``). With ``elastic=(min_num_proc, max_num_proc)`` it runs ``run_elastic`` instead:
a lost rank relaunches the stage on the slots that are free then.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from spark_hvd.runner import cluster
from spark_hvd.runner.client import Event
from spark_hvd.runner.errors import NotEnoughSlotsError
from spark_hvd.runner.slots import resolve_num_proc, slots
from spark_hvd.runner.spark import run_checked, slot_wait_s

__all__ = ["SparkBackend"]


class SparkBackend:
    """Runs a function on ``num_proc`` ranks of one Spark barrier stage of ``spark``.

    ``use_gpu``, ``max_retries``, ``verbose``, ``env``, ``start_timeout`` and ``encrypt`` are ``run``'s. ``elastic``:
    ``(min_num_proc, max_num_proc)`` to run on ``run_elastic`` (``num_proc`` ranks first, clamped into that
    range), with at most ``reset_limit`` relaunches (None: no limit); None: a plain ``run``.
    """

    def __init__(self, spark: Any, num_proc: int | None = None, *, use_gpu: bool | None = None,
                 max_retries: int = 0, verbose: int = 1, env: dict[str, str] | None = None,
                 start_timeout: float | None = None, elastic: tuple[int, int | None] | None = None,
                 reset_limit: int | None = None, encrypt: bool | None = None) -> None:
        self.spark = spark
        self._requested = num_proc
        self._num_proc: int | None = None
        self.use_gpu = use_gpu
        self.max_retries = max_retries
        self.verbose = verbose
        self.env = env
        self.start_timeout = start_timeout
        self.elastic = elastic
        self.reset_limit = reset_limit
        self.encrypt = encrypt

    def num_processes(self) -> int:
        """``num_proc`` (default: the session's default parallelism), its free slots checked on the first call
        (``NotEnoughSlotsError``; waiting ``start_timeout`` for them as ``run`` does); later calls return the same
        number without a check. Elastic: the first launch's size, ``num_proc`` clamped into ``[min_num_proc,
        max_num_proc]``; only a ``local[N]`` master (whose slots never grow) with fewer than ``min_num_proc`` is
        refused here (``run_elastic`` waits for the free slots)."""
        if self._num_proc is None:
            self._num_proc = self._elastic_size() if self.elastic else resolve_num_proc(
                self.spark, self._requested, slot_wait_s(self.spark, self.start_timeout))
        return self._num_proc

    def _elastic_size(self) -> int:
        low, high = self.elastic
        num_proc = cluster.default_parallelism(self.spark) if self._requested is None else int(self._requested)
        if high is None:  # max_num_proc defaults to num_proc
            high = max(low, num_proc)
            self.elastic = (low, high)
        total = cluster.total_slots(self.spark) if cluster.is_connect(self.spark) \
            else slots(self.spark.sparkContext)[1]
        if total is not None and total < low and cluster.is_local_master(self.spark):
            raise NotEnoughSlotsError(low, total, total, param="min_num_proc")
        return max(low, min(num_proc, high))

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
            on_event: Callable[[Event], None] | None = None) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results by rank (see ``spark_hvd.runner.run``; elastic: of the
        last attempt, ``run_elastic``)."""
        if self.elastic:
            from spark_hvd.runner.elastic import run_elastic

            num_proc = self.num_processes()  # resolves max_num_proc's default
            low, high = self.elastic
            return run_elastic(fn, args, kwargs, num_proc=num_proc, min_num_proc=low, max_num_proc=high,
                               start_timeout=self.start_timeout, reset_limit=self.reset_limit, env=self.env,
                               verbose=self.verbose, use_gpu=self.use_gpu, on_event=on_event, spark=self.spark,
                               encrypt=self.encrypt)
        return run_checked(self.spark, self.num_processes(), fn, args, kwargs, env=self.env,
                           start_timeout=self.start_timeout, use_gpu=self.use_gpu, max_retries=self.max_retries,
                           verbose=self.verbose, on_event=on_event, encrypt=self.encrypt)
