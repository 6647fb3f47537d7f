"""Fixtures of the estimator tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def mlflow_tracking(tmp_path, monkeypatch):
    """A file-store MLflow tracking URI for one test, set as the active URI and restored afterwards.

    ``mlflow.set_tracking_uri`` is process-global and wins over ``MLFLOW_TRACKING_URI``, so a test that set it
    and left it set would send the next test's runs to its own directory.
    """
    import mlflow

    tracking = tmp_path / "mlruns"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tracking}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"file://{tracking}")
    yield tracking
    mlflow.set_tracking_uri(previous)
