"""Fixtures shared by the whole suite: one SparkSession per test run, started on first use, and one Spark Connect
session on the same JVM, also started on first use (``spark_connect``; ``any_spark`` runs a test on both)."""

from __future__ import annotations

import os
import sys

import pytest
from helpers.net import free_port

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every Spark driver JVM of the suite (the shared session, and the fresh drivers the demo, notebook, spark-submit and
# interrupt tests start; they inherit this) lives for seconds to minutes on small data: the C1 compiler alone and the
# serial collector start one with ~10 CPU-s less (23 -> 13 measured here), and 2 cores are the suite's bottleneck.
os.environ.setdefault("SPARK_SUBMIT_OPTS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")


@pytest.fixture(scope="session")
def spark():
    """A ``local[2]`` SparkSession shared by every test that asks for it (started once, ~10 s)."""
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("spark_hvd-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.driver.memory", "2g")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.python.worker.reuse", "true")
        .config("spark.connect.grpc.binding.address", "127.0.0.1")  # used only if a test asks for spark_connect
        .config("spark.connect.grpc.binding.port", str(free_port()))
        .getOrCreate()
    )
    yield session
    session.stop()


@pytest.fixture(scope="session")
def spark_connect(spark):
    """A Spark Connect session (what Databricks shared / serverless compute gives a notebook), served by a Connect
    server started on the shared session's JVM when first asked for (< 1 s; no second JVM).

    It is not left as the thread's active session, so tests that do not ask for it stay on the classic one. The
    test process also holds a classic ``SparkContext``; the code under test must not use it for a Connect session.
    """
    import pyspark
    from py4j.java_gateway import JavaClass

    jvm = spark.sparkContext._jvm
    if not isinstance(jvm.org.apache.spark.sql.connect.service.SparkConnectService, JavaClass):
        pytest.skip(f"pyspark {pyspark.__version__} has no Spark Connect server in its jars (pyspark ships it from 4.0;"
                    " 3.5 needs the spark-connect package from Maven, which these tests do not fetch)")
    try:
        from pyspark.sql.connect.session import SparkSession as ConnectSession
    except Exception as e:  # noqa: BLE001 - e.g. PyPI's pyspark 4.1 protos with a runtime's protobuf 5 (VersionError)
        pytest.skip(f"pyspark {pyspark.__version__}'s Connect client does not load here: {type(e).__name__}: "
                    f"{str(e).splitlines()[0][:200]}")

    jvm.org.apache.spark.sql.connect.service.SparkConnectService.start(spark.sparkContext._jsc.sc())
    port = spark.sparkContext.getConf().get("spark.connect.grpc.binding.port")
    session = ConnectSession.builder.remote(f"sc://127.0.0.1:{port}").create()
    ConnectSession._active_session.session = None  # private: keep the classic session the default
    yield session
    session.stop()
    jvm.org.apache.spark.sql.connect.service.SparkConnectService.stop(
        jvm.scala.Option.empty(), jvm.scala.Option.empty())


@pytest.fixture
def connect_mode(spark_connect, monkeypatch):
    """``spark_connect`` with the process in Connect mode as a Databricks notebook is (``SPARK_CONNECT_MODE_ENABLED``:
    ``pyspark.sql.functions`` and ``pyspark.ml`` then build Connect objects) and as the thread's active session."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    monkeypatch.setenv("SPARK_CONNECT_MODE_ENABLED", "1")
    ConnectSession._active_session.session = spark_connect
    try:
        yield spark_connect
    finally:
        ConnectSession._active_session.session = None


@pytest.fixture(params=["classic", "connect"])
def any_spark(request):
    """The test runs twice: on the classic session, and on the Spark Connect one in Connect mode (``connect_mode``)."""
    yield request.getfixturevalue("spark" if request.param == "classic" else "connect_mode")
