"""What spark_hvd needs from a Spark session, the same for a classic session and a Spark Connect one.

Databricks' shared-access clusters and serverless compute hand notebooks a Spark Connect session
(``pyspark.sql.connect.session.SparkSession``): no ``sparkContext``, no RDDs, no broadcast variables. Everything
spark_hvd does on the driver goes through the helpers here, which use DataFrame and ``spark.conf`` APIs on
Connect and keep the cheaper ``SparkContext`` calls on a classic session:

- ``active_session(spark)``: the session to use (an explicit one, else the active Connect one, else the classic one);
- ``is_connect(spark)``, ``master(spark)``, ``is_local_master(spark)``, ``task_max_failures(spark)``;
- ``default_parallelism(spark)``: ``sc.defaultParallelism``, or on Connect the partitions of ``spark.range``;
- ``total_slots(spark)``: the slot count where the session can tell it (classic; ``local[N]`` on Connect), else None;
- ``driver_host(spark)``: where the ranks reach the driver service (``SPARK_HVD_DRIVER_HOST`` overrides);
- ``share(spark, data)``: bytes for the executors: a broadcast variable on classic, carried in the function's
  closure on Connect (the caller caches what it builds from them once per Python worker).
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from spark_hvd.runner.errors import RunnerError

log = logging.getLogger(__name__)

#: Overrides the host name the ranks use to reach the driver service (e.g. a Spark Connect client that does not
#: run on the cluster's driver node but is reachable from the executors).
DRIVER_HOST_ENV = "SPARK_HVD_DRIVER_HOST"

_LOCAL_MASTER = re.compile(r"^local(\[(\d+|\*)(,\s*\d+)?\])?$")


def is_connect(spark: Any) -> bool:
    """Whether ``spark`` is a Spark Connect session (no ``sparkContext``)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def active_session(spark: Any = None) -> Any:
    """``spark`` if given, else this thread's active Spark Connect session, else the active classic session.

    Raises ``RunnerError`` when there is none.
    """
    if spark is not None:
        return spark
    try:
        from pyspark.sql.connect.session import SparkSession as ConnectSession

        session = ConnectSession.getActiveSession()
    except ImportError:  # pyspark without the Connect extras (grpcio, ...)
        session = None
    except Exception as e:  # noqa: BLE001 - Connect's modules present but unloadable (e.g. protobuf's VersionError)
        log.debug("Spark Connect is not usable here (%s: %s); looking for a classic session", type(e).__name__, e)
        session = None
    if session is None:
        from pyspark.sql import SparkSession

        session = SparkSession.getActiveSession()
    if session is None:
        raise RunnerError("spark_hvd needs an active SparkSession (classic or Spark Connect): create one first, "
                          "or pass spark=...")
    return session


def master(spark: Any) -> str:
    """The session's master URL (``""`` where a Connect server does not say)."""
    if not is_connect(spark):
        return str(spark.sparkContext.master)
    try:
        return str(spark.conf.get("spark.master", "") or "")
    except Exception:  # a server that refuses to show static confs
        return ""


def is_local_master(spark: Any) -> bool:
    """``local`` / ``local[N]``: the executor lives in the driver's JVM (not ``local-cluster``)."""
    url = master(spark)
    return url == "local" or url.startswith("local[")


def _local_cores(url: str) -> int | None:
    found = _LOCAL_MASTER.match(url.strip())
    if not found:
        return None
    if found.group(2) is None:
        return 1
    return (os.cpu_count() or 1) if found.group(2) == "*" else int(found.group(2))


def task_max_failures(spark: Any) -> int:
    """How often Spark lets one task fail before it fails the job: ``local[N]`` 1, ``local[N,F]`` F, otherwise
    ``spark.task.maxFailures`` (Spark's default 4)."""
    url = master(spark).strip()
    found = _LOCAL_MASTER.match(url)
    if found:
        return int(found.group(3).lstrip(", ")) if found.group(3) else 1
    try:
        raw = spark.conf.get("spark.task.maxFailures", "4")
        return max(1, int(raw or 4))
    except Exception:  # a Connect server that refuses to show the conf, or a value that is not a number
        return 4


def default_parallelism(spark: Any) -> int:
    """The cluster's default parallelism: ``sc.defaultParallelism`` on classic; on Connect the number of
    partitions of ``spark.range`` (the same number: Spark splits a range by the default parallelism)."""
    if not is_connect(spark):
        return int(spark.sparkContext.defaultParallelism)
    from pyspark.sql.connect import functions as F

    row = spark.range(0, 1 << 16).agg(F.max(F.spark_partition_id()).alias("last")).first()
    return int(row["last"]) + 1


def total_slots(spark: Any) -> int | None:
    """The concurrent task slots where the session can tell them without a ``SparkContext``: ``N`` for a
    ``local[N]`` master; None otherwise (a Connect session to a cluster does not say)."""
    return _local_cores(master(spark))


def driver_host(spark: Any) -> str:
    """The host name executors use to reach a service on this driver process.

    ``SPARK_HVD_DRIVER_HOST`` if set; else ``spark.driver.host``. On Connect that is the host of the server's
    driver, which is this process's host in a Databricks notebook (the notebook's Python runs on the driver node);
    a Connect client elsewhere must set ``SPARK_HVD_DRIVER_HOST`` to an address the executors can reach.
    """
    override = os.environ.get(DRIVER_HOST_ENV)
    if override:
        return override
    import socket

    try:
        if is_connect(spark):
            host = spark.conf.get("spark.driver.host", None)
        else:
            host = spark.sparkContext.getConf().get("spark.driver.host")
    except Exception:
        host = None
    return str(host) if host else socket.gethostname()


class Shipped:
    """Bytes carried to the executors inside a function's closure (Connect has no broadcast variables)."""

    __slots__ = ("value",)

    def __init__(self, value: bytes) -> None:
        self.value = value


def share(spark: Any, data: bytes) -> Any:
    """An object whose ``.value`` gives ``data`` on the executors: a broadcast variable on a classic session (sent
    once per executor), a ``Shipped`` holder on Connect (sent with the plan of each query that uses it)."""
    if is_connect(spark):
        return Shipped(data)
    return spark.sparkContext.broadcast(data)
