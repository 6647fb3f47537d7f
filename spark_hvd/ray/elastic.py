"""Elastic training on Ray: ``RayExecutor(settings, min_workers=..., max_workers=...).run(fn)``.

The same design, and the same code, as ``spark_hvd.runner.run_elastic`` on Spark, with Ray's actors for the barrier
stage: every reset is a new *attempt*, a fresh set of workers (``RayExecutor._start_workers``), as many as Ray can
place (between ``min_workers`` and ``max_workers``). What is shared with Spark's elastic runner, not copied:

* the rank side, ``spark_hvd.runner.elastic.elastic_rank``: ``fn`` runs with a ``DriverLink`` over the rank's
  connection to the driver service; ``state.commit()`` on rank 0 streams the state to the driver, a relaunched
  rank 0's first ``state.sync()`` fetches it, ``HostsUpdatedInterrupt`` ends the attempt cleanly
  (``spark_hvd.core.elastic``: ``State``, ``ObjectState``; ``TorchState`` / ``KerasState`` in the bindings);
* the driver side, ``spark_hvd.runner.elastic.ElasticDriver``: the committed state on the driver's disk, served to the
  ranks through the ``DriverService`` (``spark_hvd.runner.service``) of each attempt; only its growth check
  differs (``RayElasticDriver.free``: Ray could place one more worker);
* which failures are recovered (``is_recoverable``: a lost rank, or a rank that failed because of one; an exception
  of ``fn``'s own fails the run), ``reset_limit`` and ``elastic_timeout`` (``HOROVOD_ELASTIC_TIMEOUT``).

Free workers are counted from ``ray.available_resources()`` (CPUs, and GPUs with ``use_gpu``) over the whole
cluster, not node by node: a worker's bundle that fits nowhere waits for the placement group timeout. After a
reset the driver waits ``cooldown_s`` (Horovod's ``cooldown_range``, its lower end) for Ray to settle (a dead
node's resources to go, pending actors to be placed) before it counts.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from spark_hvd.ray.errors import RayExecutorError, RayWorkerFailedError
from spark_hvd.runner.elastic import ElasticDriver, ElasticError, Resized, elastic_rank, is_recoverable

logger = logging.getLogger(__name__)

#: Seconds the driver waits after a reset before counting free workers (``cooldown_range`` overrides it).
COOLDOWN_S = 1.0


def free_workers(ray: Any, cpus_per_worker: float, gpus_per_worker: float) -> int:
    """How many more workers of that size Ray's free resources hold (the whole cluster's, see the docstring)."""
    available = ray.available_resources()
    counts = []
    if cpus_per_worker:
        counts.append(math.floor(available.get("CPU", 0.0) / cpus_per_worker + 1e-9))
    if gpus_per_worker:
        counts.append(math.floor(available.get("GPU", 0.0) / gpus_per_worker + 1e-9))
    return min(counts) if counts else 0


class RayElasticDriver(ElasticDriver):
    """Spark's elastic driver state (commits on the driver's disk) with Ray's growth check: the job can grow while
    it is below ``max_workers`` and ``free()`` says Ray could place another worker."""

    def __init__(self, max_workers: int, free: Callable[[], int]) -> None:
        super().__init__(None, max_workers)
        self.free = free

    def _hosts(self, rank: int, _: Any) -> bool:
        try:
            free = self.free()
        except Exception:  # best effort, as on Spark: no growth this time
            logger.debug("spark_hvd.ray: free worker query failed", exc_info=True)
            free = 0
        return self.size < self.max_num_proc and free > 0


def wait_workers(free: Callable[[], int], low: int, high: int, timeout_s: float, why: str) -> int:
    """``min(high, free())`` once ``free()`` is at least ``low``; ``ElasticError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        count = free()
        if count >= low:
            return min(high, count)
        if time.monotonic() > deadline:
            raise ElasticError(f"RayExecutor {why}: min_workers={low} workers are needed but Ray could place only "
                               f"{count} within elastic_timeout={timeout_s:g} s; add nodes or lower min_workers")
        time.sleep(0.5)


def run_elastic(executor: Any, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The elastic ``RayExecutor.run``: the results of the last attempt by rank (see the module docstring)."""
    import ray  # the executor checked that it is there
    params = executor.elastic
    gpus = executor.gpus_per_worker if executor.use_gpu else 0

    def free() -> int:
        return free_workers(ray, executor.cpus_per_worker, gpus)

    low, high = params.min_workers, params.max_workers
    driver = RayElasticDriver(high, lambda: free())
    resets = 0
    try:
        size = wait_workers(free, low, high, params.elastic_timeout, "could not start")
        for attempt in range(1 << 30):
            driver.size = size
            logger.info("spark_hvd.ray elastic: attempt %d with %d workers", attempt, size)
            why = ""
            try:
                executor._start_workers(size, attempt, handlers=driver.handlers())
                results = executor._wait_all([w.run.remote(elastic_rank, (fn, tuple(args), dict(kwargs)))
                                              for w in executor.workers], "run")
                if any(isinstance(r, Resized) for r in results):
                    why = "to grow"
            except RayWorkerFailedError as exc:
                if not is_recoverable(exc):
                    raise
                why = f"after {str(exc).splitlines()[0]}"
            except RayExecutorError as exc:  # the workers could not be placed or started
                why = f"after {exc}"
            finally:
                executor._stop_workers()
            if not why:
                return results
            resets += 1
            if params.reset_limit is not None and resets > params.reset_limit:
                raise ElasticError(f"RayExecutor: reset_limit={params.reset_limit} reached; the last reset was "
                                   f"needed {why}")
            logger.warning("spark_hvd.ray elastic: relaunching (reset %d) %s", resets, why)
            time.sleep(params.cooldown_s)
            size = wait_workers(free, low, high, params.elastic_timeout, f"reset {resets} ({why})")
        raise AssertionError("unreachable")
    finally:
        driver.close()
