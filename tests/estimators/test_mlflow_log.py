"""A fit's ``mlflow={"experiment": name}`` names the experiment of that fit's run only: the user's process is left
with the experiment it had, so a later ``mlflow.start_run()``, in another tracking store too, does not reach for
an experiment id from the fit's store (this once failed every MLflow test that ran after a fit that named one)."""

from __future__ import annotations

import pytest

from spark_hvd.estimators.common.mlflow_log import MlflowRun

pytest.importorskip("mlflow")


def test_a_named_experiment_stays_with_the_fits_run(tmp_path, mlflow_tracking):
    import mlflow

    before = mlflow.tracking.fluent._get_experiment_id()
    run = MlflowRun({"experiment": "named-by-the-fit", "registered_model_name": None}, "fit").start({"lr": 0.1})
    try:
        assert mlflow.get_run(run.run_id).info.experiment_id == \
            mlflow.get_experiment_by_name("named-by-the-fit").experiment_id
    finally:
        run.fail()
    assert mlflow.get_run(run.run_id).info.status == "FAILED"
    assert mlflow.tracking.fluent._get_experiment_id() == before
    # a second fit naming it again finds it rather than creating another
    again = MlflowRun({"experiment": "named-by-the-fit", "registered_model_name": None}, "fit").start({})
    again.fail()
    assert mlflow.get_run(again.run_id).info.experiment_id == mlflow.get_run(run.run_id).info.experiment_id

    other = tmp_path / "other-store"
    mlflow.set_tracking_uri(f"file://{other}")
    with mlflow.start_run() as fresh:  # the default experiment of the other store
        assert fresh.info.experiment_id == "0"
