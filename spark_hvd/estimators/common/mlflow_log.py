"""An estimator fit's MLflow run, logged live: params when training starts, each epoch's metrics as rank 0
reports it (``on_event``, on the driver service's thread: an explicit ``MlflowClient`` call, since MLflow's
active run is thread-local), and at the end the model with a signature and an input example taken from the
training DataFrame, registered under ``registered_model_name`` when one is given; beside it, the whole stage as a
pyfunc that scores raw columns as ``transform`` does (``stage``: ``estimators/pyfunc.py``).

The ``mlflow`` param: None/False (off), True (the active experiment), an experiment name, or a dict
``{"experiment": name, "registered_model_name": name}`` (both optional).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from spark_hvd.estimators.common import compat

log = logging.getLogger(__name__)

#: Rows of the training DataFrame kept as the logged model's input example.
EXAMPLE_ROWS = 5
#: The name of the stage's pyfunc (``<Model>.log_mlflow``), logged beside the framework's model in a fit's run.
STAGE_MODEL_NAME = "stage"


def mlflow_options(value: Any) -> dict[str, str | None]:
    """The ``mlflow`` param as ``{"experiment": ..., "registered_model_name": ...}`` (experiment "" = active)."""
    if isinstance(value, dict):
        unknown = set(value) - {"experiment", "registered_model_name"}
        if unknown:
            raise ValueError(f"mlflow: unknown key(s) {sorted(unknown)}; use 'experiment' and "
                             "'registered_model_name'")
        return {"experiment": value.get("experiment") or "",
                "registered_model_name": value.get("registered_model_name")}
    return {"experiment": value or "", "registered_model_name": None}


def _experiment_id(client: Any, name: str) -> str:
    """The id of the experiment called ``name``, created if there is none (restored if it was deleted)."""
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        return client.create_experiment(name)
    if experiment.lifecycle_stage == "deleted":
        client.restore_experiment(experiment.experiment_id)
    return experiment.experiment_id


class MlflowRun:
    """The MLflow run of one ``fit`` (see the module docstring); ``start`` opens it, ``finish``/``fail`` close it."""

    def __init__(self, options: dict[str, str | None], run_name: str) -> None:
        self.options = options
        self.run_name = run_name
        self.run_id: str | None = None
        self._client: Any = None
        self._nested = False
        self._logged: set[int] = set()

    def start(self, params: dict[str, Any], earlier: dict[str, list[float]] | None = None) -> MlflowRun:
        """Open the run (nested under an active one) and log ``params``, and ``earlier`` epochs' metrics (those of
        a fit this one resumes), so the run's history is in epoch order."""
        import mlflow

        self._client = mlflow.tracking.MlflowClient()
        # the experiment is named for this run only: ``mlflow.set_experiment`` would leave it active in the
        # user's process (and stale once they point MLflow at another tracking store)
        experiment_id = _experiment_id(self._client, self.options["experiment"]) if self.options["experiment"] else None
        self._nested = mlflow.active_run() is not None
        run = mlflow.start_run(run_name=self.run_name, nested=self._nested, experiment_id=experiment_id)
        self.run_id = run.info.run_id
        mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
        for key, values in (earlier or {}).items():
            for epoch, value in enumerate(values):
                self._client.log_metric(self.run_id, key, float(value), step=epoch)
                self._logged.add(epoch)
        return self

    def on_event(self, event: Any) -> None:
        """Log rank 0's end-of-epoch metrics (step = epoch) the moment they arrive."""
        if event.rank != 0 or event.epoch is None or event.step is not None or self.run_id is None:
            return
        from mlflow.entities import Metric

        stamp = int((event.time or time.time()) * 1000)
        metrics = [Metric(k, float(v), stamp, int(event.epoch)) for k, v in event.metrics.items()
                   if isinstance(v, int | float) and not isinstance(v, bool)]
        try:
            self._client.log_batch(self.run_id, metrics=metrics)
            self._logged.add(int(event.epoch))
        except Exception:  # tracking trouble must not stop the training
            log.exception("MLflow: logging the metrics of epoch %s failed", event.epoch)

    def finish(self, model: Any, df: Any, log_model: Any) -> None:
        """Log the history's epochs that were not logged live, then ``model`` (a fitted ``BaseModel``) through
        ``log_model(framework_model, **mlflow_kwargs)`` with a signature and an input example from ``df``,
        registered if asked; end the run."""
        import mlflow

        # epochs neither resumed nor reported live (a report lost on the way)
        for key, values in model.getHistory().items():
            for epoch, value in enumerate(values):
                if epoch not in self._logged:
                    self._client.log_metric(self.run_id, key, float(value), step=epoch)
        # the model is the output of the run after its last epoch; MLflow 3 would copy the run's metrics of the
        # step given here onto the model, which duplicates them in the run's history: a step with none
        kwargs: dict[str, Any] = {"step": max((len(v) for v in model.getHistory().values()), default=0)}
        if self.options["registered_model_name"]:
            kwargs["registered_model_name"] = self.options["registered_model_name"]
        example = input_example(model, df)
        if example is not None:
            from mlflow.models import infer_signature

            output = model._predict(model.getModel(), [example])
            kwargs["input_example"] = example
            kwargs["signature"] = infer_signature(example, np.asarray(output[0]) if len(output) == 1 else
                                                  {c: np.asarray(o) for c, o in zip(model.getOutputCols(), output,
                                                                                    strict=True)})
        try:
            log_model(model.getModel(), **kwargs)
            log_stage = getattr(model, "log_mlflow", None)
            if log_stage is not None:  # the whole stage as a pyfunc that scores raw columns (estimators/pyfunc.py)
                log_stage(name=STAGE_MODEL_NAME, input_example=df, log_network=False, step=kwargs["step"])
        finally:
            mlflow.end_run()

    def fail(self) -> None:
        """End the run as FAILED (the fit raised)."""
        import mlflow

        if self.run_id is not None:
            mlflow.end_run(status="FAILED")


def input_example(model: Any, df: Any) -> np.ndarray | None:
    """The first rows of ``df``'s feature column as the model's ``transform`` feeds them to the model (Vectors as
    arrays, the trained dtype and shape); None with several feature columns (a pyfunc takes one array)."""
    specs = model._feature_specs()
    if len(specs) != 1:
        log.info("MLflow: %d feature columns: the model is logged without an input example or signature",
                 len(specs))
        return None
    from spark_hvd.estimators.common.arrow import feature_to_numpy

    prepared, feature_idx, _ = model._prepared_input(df.limit(EXAMPLE_ROWS))
    rows = compat.to_arrow(prepared)
    spec = specs[0]
    return feature_to_numpy(rows.column(feature_idx[0]), spec["name"], spec["dtype"], spec["shape"])
