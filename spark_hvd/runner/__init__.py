"""Running spark_hvd jobs: ``run(fn, num_proc)`` on a Spark barrier stage, ``spark-hvd-run`` for local processes.

- ``run(fn, args, kwargs, num_proc, env, start_timeout, use_gpu, max_retries, verbose, on_event=None,
  encrypt=None)``: the results of ``fn`` by rank; a failure on any rank raises ``RankFailedError`` naming it, with
  its traceback.
- ``report(epoch=..., step=..., **metrics)`` from training code: progress shown on the driver and handed to
  ``on_event`` / ``last_events()``; ``StepReporter`` sends rank 0's batches (throttled) for the driver's progress
  bar (``ProgressDisplay``).
- ``run(..., spark=...)`` works on a classic SparkSession and on a Spark Connect one (``spark_hvd.runner.cluster``);
  ``resolve_num_proc(spark, num_proc)`` is its num_proc default and slot check.
- ``run_local(argv, np, env, timeout)``: the Python API of ``spark-hvd-run``.
- ``run_elastic(fn, num_proc, min_num_proc, max_num_proc, ...)``: Horovod's elastic training: a lost rank or free
  slots relaunch the barrier stage, which resumes from the last ``state.commit()`` (``spark_hvd.runner.elastic``).
- ``check_slots(sc, num_proc)``: the slot check ``run`` does first (``NotEnoughSlotsError`` with both numbers).

Events carry ``attempt``: with ``max_retries`` the events of failed attempts are kept too.

Importing this package does not import pyspark (``run`` imports it when called).
"""

from spark_hvd.runner.client import Event, report
from spark_hvd.runner.elastic import ElasticError, run_elastic
from spark_hvd.runner.errors import (
    NotEnoughSlotsError,
    RankFailedError,
    RankFailure,
    RunnerError,
    StageNotStartedError,
    StartTimeoutError,
)
from spark_hvd.runner.launch import LaunchResult, run_local
from spark_hvd.runner.progress import ProgressDisplay, StepReporter
from spark_hvd.runner.slots import check_slots, resolve_num_proc
from spark_hvd.runner.spark import last_events, run

__all__ = [
    "ElasticError",
    "Event",
    "LaunchResult",
    "NotEnoughSlotsError",
    "ProgressDisplay",
    "RankFailedError",
    "RankFailure",
    "RunnerError",
    "StageNotStartedError",
    "StartTimeoutError",
    "StepReporter",
    "check_slots",
    "last_events",
    "report",
    "resolve_num_proc",
    "run",
    "run_elastic",
    "run_local",
]
