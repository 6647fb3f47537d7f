"""What differs between the versions of pyspark.ml, MLflow and Lightning that the estimators run on, in one place.

Each function says which versions take which branch (the Spark version itself comes from
``spark_hvd.runner.compat``), so a branch can be deleted when the floor moves:

- ``save_metadata`` / ``load_metadata``: Spark ML's ``DefaultParamsWriter.saveMetadata`` /
  ``DefaultParamsReader.loadMetadata`` on a classic session (any Spark) or a Spark Connect one (Spark >= 4.0);
- ``to_arrow(df)``: a DataFrame's rows as one ``pyarrow.Table`` (``DataFrame.toArrow`` is Spark >= 4.0);
- ``finish_saved_batch(state)``: a Lightning checkpoint taken in ``on_train_batch_end`` resumes after that batch
  (Lightning 2.5 does it itself, 2.3-2.4 do not); ``starts_resumed_epoch()``: whether Lightning calls
  ``on_train_epoch_start`` again for the epoch a mid-epoch checkpoint resumes;
- ``log_model``: an MLflow flavor's ``log_model`` with the keywords that MLflow version takes (``name=`` and
  ``step=`` from MLflow 3.0, ``artifact_path=`` before; ``serialization_format=`` where the flavor has it).
- ``keras_export``: ``keras.Model.export`` with the keywords that Keras version takes (3.3 has none but the
  format).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from spark_hvd.estimators.common.errors import EstimatorError
from spark_hvd.runner import cluster
from spark_hvd.runner import compat as spark_compat


def _ml_context(spark: Any, what: str) -> Any:
    """What ``saveMetadata`` / ``loadMetadata`` take as their ``sc`` argument.

    Spark >= 4.0: the session itself, classic or Connect (pyspark.ml writes through DataFrames).
    Spark 3.5: a classic session's ``SparkContext`` (3.5 calls ``sc.parallelize`` / ``sc.textFile``); a Spark
    Connect session has none, and pyspark.ml persistence on Connect needs 4.0: ``EstimatorError`` says so.
    """
    if spark_compat.spark_version() >= (4, 0):
        return spark
    if cluster.is_connect(spark):
        spark_compat.require_spark(f"{what} on a Spark Connect session", 4, 0, error=EstimatorError)
    return spark.sparkContext


def save_metadata(instance: Any, path: str, spark: Any, **kwargs: Any) -> None:
    """``DefaultParamsWriter.saveMetadata(instance, path, <session or context>, **kwargs)`` (``_ml_context``)."""
    from pyspark.ml.util import DefaultParamsWriter

    DefaultParamsWriter.saveMetadata(instance, path, _ml_context(spark, f"saving a {type(instance).__name__}"),
                                     **kwargs)


def load_metadata(path: str, spark: Any) -> dict[str, Any]:
    """``DefaultParamsReader.loadMetadata(path, <session or context>)`` (``_ml_context``)."""
    from pyspark.ml.util import DefaultParamsReader

    return DefaultParamsReader.loadMetadata(path, _ml_context(spark, f"loading the stage at {path}"))


def to_arrow(df: Any) -> Any:
    """``df`` collected to the driver as a ``pyarrow.Table`` (call it on small DataFrames: one row, a few rows).

    Spark >= 4.0: ``df.toArrow()`` (classic and Connect). Spark 3.5 has no ``toArrow``: a classic DataFrame's
    Arrow batches (``_collect_as_arrow``, what 3.5's ``toPandas`` uses; an empty result takes its schema from
    ``df.schema``), a Connect one's table from its client (``client.to_table``, what 3.5's ``toPandas`` uses).
    """
    if spark_compat.spark_version() >= (4, 0):
        return df.toArrow()
    import pyarrow as pa

    if cluster.is_connect(df.sparkSession):
        table, _ = df._session.client.to_table(df._plan.to_proto(df._session.client))
        return table
    batches = df._collect_as_arrow()
    if batches:
        return pa.Table.from_batches(batches)
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(df.schema).empty_table()


def log_model(flavor_log_model: Callable[..., Any], model: Any, name: str, **kwargs: Any) -> Any:
    """``flavor_log_model(model, name=name, **kwargs)`` (``mlflow.pytorch.log_model``, ``mlflow.keras.log_model``),
    the keywords fitted to the installed MLflow:

    - MLflow >= 3.0 names the logged model ``name=``; MLflow 2.x (Databricks 15.4 LTS ML has 2.13.1, 16.4 2.21)
      takes ``artifact_path=`` (3.x still accepts it, deprecated).
    - ``step=`` (the run's step the model is logged at) exists from MLflow 3.0; 2.x has no such argument: dropped.
    - any other keyword the flavor's signature does not name (``serialization_format=``, which
      ``mlflow.pytorch.log_model`` has only in recent 3.x releases) is dropped too, rather than falling into
      the flavor's ``**kwargs`` (which ``mlflow.pytorch`` hands to ``torch.save``).
    """
    params = inspect.signature(flavor_log_model).parameters
    kwargs["name" if "name" in params else "artifact_path"] = name
    return flavor_log_model(model, **{k: v for k, v in kwargs.items() if k in params})


def keras_export(model: Any, filepath: str, format: str, **kwargs: Any) -> None:  # noqa: A002
    """``model.export(filepath, format=format, **kwargs)`` with the keywords that Keras version takes.

    Keras 3.3 (Databricks 15.4 LTS ML) has ``export(filepath, format="tf_saved_model")`` only: the other keywords
    are dropped there (its SavedModel leaves the batch dimension open anyway, and it has no ``"onnx"`` format,
    which it refuses itself); recent Keras 3 takes ``verbose=``, ``input_signature=`` and format-specific
    keywords (``opset_version=`` for ONNX).
    """
    params = inspect.signature(model.export).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    model.export(filepath, format=format, **kwargs)


def starts_resumed_epoch() -> bool:
    """Whether Lightning calls ``on_train_epoch_start`` for the epoch a mid-epoch checkpoint resumes: Lightning
    2.3-2.4 do (a callback that resets its epoch sums there would drop the restored ones); Lightning >= 2.5 (its
    training epoch loop has ``RestartStage``) do not."""
    from lightning.pytorch.loops import training_epoch_loop

    return not hasattr(training_epoch_loop, "RestartStage")


def finish_saved_batch(state: dict) -> None:
    """Make a Lightning checkpoint taken in ``on_train_batch_end`` (a step checkpoint) resume after that batch.

    Lightning >= 2.5 (its training epoch loop has ``RestartStage``) sees where the checkpoint was taken and counts
    the batch as completed itself: nothing to do. Lightning 2.3-2.4 roll the batch counter back to the last
    completed batch (``reset_on_restart``: ``ready = completed``), one short, so the resumed epoch's batch indices
    would start one lower than the data (whose first batches the reader skips) and the epoch would end a batch
    early: here the batch is marked completed, and the run's optimizer-step count advanced by it, as 2.5 does
    (without gradient accumulation).
    """
    from lightning.pytorch.loops import training_epoch_loop

    if hasattr(training_epoch_loop, "RestartStage"):
        return
    fit_loop = state.get("loops", {}).get("fit_loop", {})
    progress = fit_loop.get("epoch_loop.batch_progress")
    if not progress:
        return
    behind = int(progress["current"]["processed"]) - int(progress["current"]["completed"])
    if behind <= 0:
        return
    for part in ("current", "total"):
        progress[part]["completed"] = int(progress[part]["processed"])
    loop_state = fit_loop.get("epoch_loop.state_dict")
    if isinstance(loop_state, dict) and "_batches_that_stepped" in loop_state:
        loop_state["_batches_that_stepped"] = int(loop_state["_batches_that_stepped"]) + behind
