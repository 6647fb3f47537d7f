"""``SparkBackend``: the one way the estimators reach the runner (Horovod's ``backend`` of its Spark estimators).

An estimator builds one per ``fit``: ``num_processes()`` resolves ``num_proc`` and checks its free task slots (once,
before any data is prepared), and ``run(fn, args)`` launches the barrier stage on those processes without checking
them again (``spark.run_checked``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from spark_hvd.runner.client import Event
from spark_hvd.runner.slots import resolve_num_proc
from spark_hvd.runner.spark import run_checked

__all__ = ["SparkBackend"]


class SparkBackend:
    """Runs a function on ``num_proc`` ranks of one Spark barrier stage of ``spark``.

    ``use_gpu``, ``max_retries``, ``verbose``, ``env`` and ``start_timeout`` are ``run``'s.
    """

    def __init__(self, spark: Any, num_proc: int | None = None, *, use_gpu: bool | None = None,
                 max_retries: int = 0, verbose: int = 1, env: dict[str, str] | None = None,
                 start_timeout: float | None = None) -> None:
        self.spark = spark
        self._requested = num_proc
        self._num_proc: int | None = None
        self.use_gpu = use_gpu
        self.max_retries = max_retries
        self.verbose = verbose
        self.env = env
        self.start_timeout = start_timeout

    def num_processes(self) -> int:
        """``num_proc`` (default: the session's default parallelism), its free slots checked on the first call
        (``NotEnoughSlotsError``); later calls return the same number without a check."""
        if self._num_proc is None:
            self._num_proc = resolve_num_proc(self.spark, self._requested)
        return self._num_proc

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
            on_event: Callable[[Event], None] | None = None) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results by rank (see ``spark_hvd.runner.run``)."""
        return run_checked(self.spark, self.num_processes(), fn, args, kwargs, env=self.env,
                           start_timeout=self.start_timeout, use_gpu=self.use_gpu, max_retries=self.max_retries,
                           verbose=self.verbose, on_event=on_event)
