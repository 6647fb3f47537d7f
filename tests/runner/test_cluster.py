"""``runner.cluster.active_session`` finds a classic session where Spark Connect's modules are present but do not
load (pyspark 4.1 with a runtime's protobuf 5 raises protobuf's ``VersionError`` on importing them), rather than
failing every ``run()`` with that error."""

from __future__ import annotations

import builtins
import sys

import pytest

from spark_hvd.runner import cluster
from spark_hvd.runner.errors import RunnerError

pytestmark = pytest.mark.compat


class _VersionError(Exception):
    """Stands in for ``google.protobuf.runtime_version.VersionError`` (not an ImportError)."""


@pytest.fixture
def connect_unloadable(monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("pyspark.sql.connect"):
            raise _VersionError("Detected incompatible Protobuf Gencode/Runtime versions")
        return real_import(name, *args, **kwargs)

    for mod in [m for m in sys.modules if m.startswith("pyspark.sql.connect")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setattr(builtins, "__import__", fake_import)


def test_an_unloadable_connect_falls_back_to_the_classic_session(connect_unloadable, monkeypatch):
    from pyspark.sql import SparkSession

    classic = object()
    monkeypatch.setattr(SparkSession, "getActiveSession", classmethod(lambda cls: classic))
    assert cluster.active_session() is classic


def test_no_session_at_all_names_what_to_do(connect_unloadable, monkeypatch):
    from pyspark.sql import SparkSession

    monkeypatch.setattr(SparkSession, "getActiveSession", classmethod(lambda cls: None))
    with pytest.raises(RunnerError, match="needs an active SparkSession"):
        cluster.active_session()
