"""spark_hvd.estimators.common.compat: MLflow's log_model keywords for MLflow 2 and 3, and Spark ML metadata on Connect
before Spark 4.0 (the version is patched)."""

from __future__ import annotations

import pytest

from spark_hvd.estimators.common import compat
from spark_hvd.estimators.common.errors import EstimatorError
from spark_hvd.runner import compat as spark_compat


def _mlflow2_log_model(pytorch_model, artifact_path, registered_model_name=None, pip_requirements=None,
                       **kwargs):
    return {"artifact_path": artifact_path, "pip_requirements": pip_requirements, **kwargs}


def _mlflow3_log_model(pytorch_model, artifact_path=None, pip_requirements=None, name=None, step=0,
                       serialization_format=None, **kwargs):
    return {"name": name, "step": step, "serialization_format": serialization_format, **kwargs}


def test_log_model_names_the_model_as_each_mlflow_takes_it():
    got = compat.log_model(_mlflow2_log_model, object(), "model", step=3, serialization_format="pickle",
                           pip_requirements=["torch"])
    assert got == {"artifact_path": "model", "pip_requirements": ["torch"]}, "MLflow 2: no step=, no format"
    got = compat.log_model(_mlflow3_log_model, object(), "model", step=3, serialization_format="pickle")
    assert got == {"name": "model", "step": 3, "serialization_format": "pickle"}


def test_ml_persistence_on_connect_before_spark_4_names_the_version(monkeypatch):
    class ConnectSession:
        pass

    ConnectSession.__module__ = "pyspark.sql.connect.session"
    monkeypatch.setattr(spark_compat, "spark_version", lambda: (3, 5))
    with pytest.raises(EstimatorError, match=r"Spark Connect session needs Spark 4\.0"):
        compat.load_metadata("/nowhere", ConnectSession())
    monkeypatch.setattr(spark_compat, "spark_version", lambda: (4, 0))
    session = ConnectSession()
    assert compat._ml_context(session, "x") is session
