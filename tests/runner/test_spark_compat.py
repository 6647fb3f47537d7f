"""spark_hvd.runner.compat: each branch, whichever pyspark is installed (the version is patched), on fakes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from spark_hvd.runner import compat
from spark_hvd.runner.errors import RunnerError


class _Classic:
    """A classic session's calls, recorded (a classic SparkSession's module is not pyspark.sql.connect)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.sparkContext = SimpleNamespace(
            setJobGroup=lambda *a, **k: self.calls.append(("setJobGroup", a[0])),
            cancelJobGroup=lambda g: self.calls.append(("cancelJobGroup", g)))

    def addTag(self, tag: str) -> None:  # noqa: N802 - Spark's name
        self.calls.append(("addTag", tag))

    def removeTag(self, tag: str) -> None:  # noqa: N802 - Spark's name
        self.calls.append(("removeTag", tag))


@pytest.mark.parametrize("version, tagged", [((3, 5), False), ((4, 0), True)])
def test_a_classic_session_tags_its_jobs_only_from_spark_4(monkeypatch, version, tagged):
    monkeypatch.setattr(compat, "spark_version", lambda: version)
    spark = _Classic()
    with compat.tag_job(spark, "t", "run"):
        pass
    compat.cancel_job(spark, "t")
    tags = [("addTag", "t"), ("setJobGroup", "t"), ("removeTag", "t")] if tagged else [("setJobGroup", "t")]
    assert spark.calls == [*tags, ("cancelJobGroup", "t")]


def test_require_spark_names_the_version_needed(monkeypatch):
    monkeypatch.setattr(compat, "spark_version", lambda: (3, 5))
    compat.require_spark("anything", 3, 5)
    with pytest.raises(RunnerError, match=r"needs Spark 4\.0 or later; this session runs pyspark 3\.5"):
        compat.require_spark("a Connect feature", 4, 0)
    with pytest.raises(ValueError, match="needs Spark 4.1"):
        compat.require_spark("x", 4, 1, error=ValueError)


def test_the_installed_version_is_read():
    import pyspark

    assert compat.spark_version() == tuple(int(p) for p in pyspark.__version__.split(".")[:2])


def test_a_scala_map_converts_on_scala_2_13_and_2_12():
    scala_213 = SimpleNamespace(jdk=SimpleNamespace(javaapi=SimpleNamespace(
        CollectionConverters=SimpleNamespace(asJava=lambda m: ("2.13", m)))))
    assert compat.scala_map_as_java(SimpleNamespace(scala=scala_213), "m") == ("2.13", "m")

    def missing(m):
        raise TypeError("'JavaPackage' object is not callable")  # what py4j answers for a class the JVM lacks

    scala_212 = SimpleNamespace(jdk=SimpleNamespace(javaapi=SimpleNamespace(
        CollectionConverters=SimpleNamespace(asJava=missing))),
        collection=SimpleNamespace(JavaConverters=SimpleNamespace(mapAsJavaMap=lambda m: ("2.12", m))))
    assert compat.scala_map_as_java(SimpleNamespace(scala=scala_212), "m") == ("2.12", "m")
