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
- ``SparkBackend(spark, num_proc, env=..., encrypt=...)``: the runner the estimators use (their ``backend`` param
  takes one, as Horovod's estimators take Horovod's ``SparkBackend``).
- ``check_slots(sc, num_proc)``: the slot check ``run`` does first (``NotEnoughSlotsError`` with both numbers).

Events carry ``attempt``: with ``max_retries`` the events of failed attempts are kept too.

Importing this package does not import pyspark (``run`` imports it when called), and imports each name's
submodule on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

#: public name -> the submodule that defines it, imported on first use: a rank's task imports only
#: ``barrier_task`` and what it needs, not the driver's half (launch, elastic, multihost ...)
_PUBLIC = {
    "ElasticError": "elastic", "Event": "client", "LaunchResult": "launch", "NotEnoughSlotsError": "errors",
    "ProgressDisplay": "progress", "RankFailedError": "errors", "RankFailure": "errors", "RunnerError": "errors",
    "SlotsTimeoutError": "errors", "SparkBackend": "backend", "StageNotStartedError": "errors",
    "StartTimeoutError": "errors", "StepReporter": "progress", "check_slots": "slots", "last_events": "spark",
    "report": "client", "resolve_num_proc": "slots", "run": "spark", "run_elastic": "elastic", "run_local": "launch",
}


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
        globals()[name] = value  # once: later lookups are plain attribute reads
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ElasticError",
    "Event",
    "LaunchResult",
    "NotEnoughSlotsError",
    "ProgressDisplay",
    "RankFailedError",
    "RankFailure",
    "RunnerError",
    "SlotsTimeoutError",
    "SparkBackend",
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
