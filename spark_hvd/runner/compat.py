"""What differs between the Spark versions spark_hvd runs on (3.5.0, Databricks 14.3 / 15.4 LTS, to 4.x), in one place.

Every branch on the installed pyspark (or on the Scala library inside its JVM) is here, each function saying which
versions take which branch, so a branch can be deleted when the floor moves. The rest of the runner (and the layers
above it) call these and never compare versions themselves.

- ``spark_version()``: the installed pyspark's ``(major, minor)``;
- ``require_spark(feature, major, minor)``: an error naming the version a feature needs (on the driver,
  before any job starts);
- ``tag_job(spark, tag, description)`` / ``cancel_job(spark, tag)``: the barrier stage's job tag and job group;
- ``scala_map_as_java(jvm, scala_map)``: a Scala map from py4j as a ``java.util.Map`` (Scala 2.12 and 2.13).

Importing this module does not import pyspark (``spark_version`` reads the installed package's metadata).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from spark_hvd.runner import cluster
from spark_hvd.runner.errors import RunnerError

#: The oldest Spark spark_hvd supports (Databricks Runtime 14.3 / 15.4 LTS).
FLOOR = (3, 5)


@functools.lru_cache(maxsize=1)
def spark_version() -> tuple[int, int]:
    """The installed pyspark's ``(major, minor)`` (``(4, 0)`` for ``4.0.0``, ``(3, 5)`` for Databricks' ``3.5.0``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        text = version("pyspark")
    except PackageNotFoundError:  # a runtime that ships pyspark without its metadata (a Databricks image)
        import pyspark

        text = pyspark.__version__
    found = re.match(r"(\d+)\.(\d+)", text)
    if not found:
        raise RunnerError(f"cannot read the pyspark version {text!r}")
    return int(found.group(1)), int(found.group(2))


def require_spark(feature: str, major: int, minor: int = 0, error: type[Exception] = RunnerError) -> None:
    """Raise ``error`` (``RunnerError``) unless the installed pyspark is at least ``major.minor``: ``feature``
    needs it.

    Call it on the driver before any job starts, so a feature that cannot exist on an older Spark fails at once
    with the version it needs rather than with an ``AttributeError`` from a task.
    """
    have = spark_version()
    if have < (major, minor):
        raise error(f"{feature} needs Spark {major}.{minor} or later; this session runs pyspark "
                          f"{have[0]}.{have[1]}. Upgrade pyspark (Databricks Runtime 17.3 LTS has Spark 4.0), or "
                          f"use a classic SparkSession.")


def classic_has_tags() -> bool:
    """Whether a classic ``SparkSession`` has job tags (``addTag``/``removeTag``/``interruptTag``).

    Spark >= 4.0: yes. Spark 3.5: the methods exist but raise ``PySparkRuntimeError`` ("only supported with Spark
    Connect"); a classic session then groups its jobs with ``SparkContext.setJobGroup`` alone. Spark Connect
    sessions have tags from 3.5 on.
    """
    return spark_version() >= (4, 0)


@contextmanager
def tag_job(spark: Any, tag: str, description: str) -> Iterator[None]:
    """Jobs this thread submits inside the block carry ``tag`` (``cancel_job(spark, tag)`` stops them).

    - Spark Connect (3.5 and 4.x): the session's job tag (``addTag``), removed at the end.
    - classic, Spark >= 4.0: the job tag too, and the job group ``tag`` (``setJobGroup``, interrupting on cancel),
      whose running tasks the status tracker can count (``slots.group_tasks``).
    - classic, Spark 3.5: the job group only (classic sessions have no tags before 4.0).
    """
    connect = cluster.is_connect(spark)
    tagged = connect or classic_has_tags()
    if tagged:
        spark.addTag(tag)
    try:
        if not connect:
            spark.sparkContext.setJobGroup(tag, description, interruptOnCancel=True)
        yield
    finally:
        if tagged:
            spark.removeTag(tag)


def cancel_job(spark: Any, tag: str) -> None:
    """Cancel the jobs submitted under ``tag_job(spark, tag, ...)``: ``interruptTag`` on Spark Connect (3.5 and
    4.x), ``cancelJobGroup`` on a classic session (every version; the group was set whatever the version)."""
    if cluster.is_connect(spark):
        spark.interruptTag(tag)
    else:
        spark.sparkContext.cancelJobGroup(tag)


def scala_map_as_java(jvm: Any, scala_map: Any) -> Any:
    """A Scala ``Map`` handed over by py4j, as a ``java.util.Map`` (``.values()`` iterable from Python).

    Scala 2.13 (pyspark >= 4.0; Databricks 17.3 and later): ``scala.jdk.javaapi.CollectionConverters.asJava``.
    Scala 2.12 (pyspark 3.5 as pip ships it; Databricks 14.3 / 15.4): that class does not exist, and
    ``scala.collection.JavaConverters.mapAsJavaMap`` (deprecated in 2.13, gone later) does the same.
    """
    try:
        return jvm.scala.jdk.javaapi.CollectionConverters.asJava(scala_map)
    except Exception:  # Scala 2.12: no scala.jdk.javaapi (py4j answers "... does not exist in the JVM")
        return jvm.scala.collection.JavaConverters.mapAsJavaMap(scala_map)
