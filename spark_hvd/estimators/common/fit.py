"""``BaseEstimator``: the ``fit`` every estimator shares (check, prepare the data, train on the ranks, build the Model).

A framework estimator (``torch/estimator.py``, ``keras/estimator.py``, ``lightning/estimator.py``) adds only
what differs: how its model and optimizer become bytes and back, its typed spec (``spec.py``), the training
function run on every rank (a ``RankRun`` with the framework's ``RankTrainer``, ``rank_run.py``), and its Model
class (over ``model.py``).
"""

from __future__ import annotations

import logging
import tempfile
import time
import uuid
from typing import Any

from pyspark.ml import Estimator

from spark_hvd.estimators.common.errors import param_error
from spark_hvd.estimators.common.model import BaseModel
from spark_hvd.estimators.common.params import OBJECT_PARAMS
from spark_hvd.estimators.common.persistence import PersistableStage
from spark_hvd.estimators.common.preflight import (
    check_batch_functions_on_driver,
    check_columns,
    check_not_classes,
    check_rows,
    checked_label_shapes,
)
from spark_hvd.estimators.common.rank_run import RankTrainer, train_on_rank
from spark_hvd.estimators.common.spec import BestPolicy, TrainSpec, built_loss, model_metadata
from spark_hvd.store.run_dir import RunDir

__all__ = ["BaseEstimator"]

log = logging.getLogger(__name__)


class BaseEstimator(Estimator, PersistableStage):
    """The shared ``fit``: check everything, prepare the data, train with the runner, build the Model.

    ``fit(df)``: ``_check`` (store, positive sizes, columns with near-name hints, model via ``_check_model``, loss
    via ``_check_loss``, loss weights, run id, free task slots: nothing is written and no Spark job runs before
    these pass), then ``spark_hvd.data.prepare_data``, then ``spark_hvd.runner.run(train_on_rank,
    args=(self._trainer_class, spec))`` (``rank_run.py``) where ``spec`` holds the shared settings plus
    ``_train_spec()``; rank 0's result is ``{"history": {...}, "output_shapes": [[...] per output]}``. The Model
    is ``_model_class`` built from ``_load_trained_model(store, run_id, model_bytes)``; with ``mlflow`` set, params,
    per-epoch metrics and ``_log_mlflow_model(model)`` go to the active tracking URI.

    On the ranks a framework's training function uses ``ShardReaders`` (its shard, same step count on every
    rank), ``RunDir`` (``spark_hvd.store.run_dir``: checkpoints with the history inside, metrics log, final
    model) and ``append_history``.
    A resumed run (same ``run_id``, or a retry after a failed rank) starts after the newest complete checkpoint.
    """

    #: the Model class ``fit`` returns, the spec class the ranks receive and the ``RankTrainer`` they run (set by
    #: the framework subclass)
    _model_class: type[BaseModel] = BaseModel
    _spec_class: type = TrainSpec
    _trainer_class: type[RankTrainer] = RankTrainer
    #: the function every rank runs: ``fn(trainer_class, spec)``
    _rank_fn = staticmethod(train_on_rank)
    #: "torch" or "keras": which fix the pre-flight suggests for a class passed as an instance
    _framework = "torch"

    def fit(self, dataset: Any, params: Any = None) -> Any:
        """``pyspark.ml.Estimator.fit``. A Ctrl-C while the ranks train stops them and ends in a
        ``KeyboardInterrupt`` whose message names the run, its last checkpoint and how to resume it, raised from
        here so that the console shows that line under a short traceback (not the runner's frames)."""
        try:
            return super().fit(dataset, params)
        except KeyboardInterrupt as exc:
            if getattr(exc, "run_id", None) is None:
                raise
            again = KeyboardInterrupt(*exc.args)
            again.run_id = exc.run_id  # type: ignore[attr-defined]
            raise again from None

    def _metrics(self) -> list:
        """The ``metrics`` param as a list (empty when unset)."""
        return list(self._opt(self.metrics) or [])

    # ---- framework hooks
    def _check_model(self, model: Any) -> bytes:
        """Raise ``TypeError`` unless ``model`` is a model of this framework that serialises; return its bytes."""
        raise NotImplementedError

    def _check_loss(self, n_labels: int) -> None:
        """Raise ``ValueError`` unless the loss param fits ``n_labels`` labels."""
        raise NotImplementedError

    def _train_spec(self) -> dict:
        """The framework's fields of its ``_spec_class`` (optimizer, loss, metrics ...), all picklable."""
        raise NotImplementedError

    def _load_trained_model(self, store: Any, run_id: str, model_bytes: bytes) -> Any:
        """The final model that rank 0 wrote to ``RunDir(store, run_id).model_path``; ``model_bytes`` are the
        user's model as the ranks got it (a framework that saves only the weights builds the model from them)."""
        raise NotImplementedError

    def _model_params(self) -> dict:
        """Extra params of the returned Model (e.g. input_shapes)."""
        return {}

    def _preflight(self, spec: TrainSpec, label_max: dict[str, float]) -> None:
        """Checks on a few prepared rows on the driver before any rank starts (the framework's ``preflight.py``;
        default none)."""

    def _classifier_kind(self) -> str | None:
        """For a one-label model, what its output is (``classifier.py``: ``logits``, ``probabilities``,
        ``binary_logits``, ``binary_probabilities``), judged from the loss; None: not a classifier."""
        return None

    @staticmethod
    def _is_class_index_loss(loss: Any) -> bool:
        """Whether ``loss`` (one label's, as the loss param gives it) takes class indices (default: none known)."""
        return False

    def _loss_value(self) -> Any:
        """The loss the ranks train with, as the params give it: built here from ``loss_constructors`` where set
        (the driver's checks call them once; the ranks call them again)."""
        fns = self._opt(self.loss_constructors) if self.hasParam("loss_constructors") else None
        if fns:
            return built_loss(None, tuple(fns))
        return self._opt(self.loss) if self.hasParam("loss") else None

    def _check_label_types(self, df: Any) -> None:
        """A class-index loss given a fractional label column is an error (0.7 would silently become 0)."""
        from pyspark.sql.types import DecimalType, DoubleType, FloatType

        labels, loss = self.getOrDefault(self.label_cols), self._loss_value()
        losses = list(loss) if isinstance(loss, list | tuple) else [loss] * len(labels)  # one per label, or one
        for col, item in zip(labels, losses, strict=False):
            fractional = isinstance(df.schema[col].dataType, FloatType | DoubleType | DecimalType)
            if (df.schema[col].metadata or {}).get("ml_attr", {}).get("type") == "nominal":
                fractional = False  # StringIndexer's output: whole class indices stored as double
            if fractional and self._is_class_index_loss(item):
                kind = df.schema[col].dataType.simpleString()
                raise param_error(self, f"label column {col!r} is {kind} but its loss takes class "
                                  "indices; cast it to an integer type "
                                  f"(df.withColumn({col!r}, df[{col!r}].cast('int')))")

    def _log_mlflow_model(self, model: Any, **kwargs: Any) -> None:
        """Log ``model`` with the framework's MLflow flavour; ``kwargs`` (signature, input_example,
        registered_model_name) go to its ``log_model``."""
        raise NotImplementedError

    # ---- checks (all before anything runs or is written)
    def _check(self, df: Any) -> dict:
        """Check every param and the DataFrame's columns; return the resolved settings. Writes nothing."""
        name = type(self).__name__
        get = self.getOrDefault
        store = self._opt(self.store)
        if store is None:
            raise param_error(name, "set store, e.g. store=Store.create('/tmp/spark_hvd_store') "
                              "(or an s3://, hdfs://, dbfs:/ URL)")
        if isinstance(store, str):
            from spark_hvd.store import Store

            store = Store.create(store)
        for param in ("batch_size", "epochs", "backward_passes_per_step", "partitions_per_process"):
            value = get(getattr(self, param))
            if value is None or value <= 0:
                raise param_error(name, f"{param} must be a positive integer, got {value!r}")
        for param in ("val_batch_size", "train_steps_per_epoch", "validation_steps_per_epoch", "num_proc",
                      "keep_checkpoints", "keep_best_checkpoints", "train_reader_num_workers",
                      "val_reader_num_workers"):
            value = get(getattr(self, param))
            if value is not None and value <= 0:
                raise param_error(name, f"{param} must be a positive integer or None, got {value!r}")
        if get(self.max_retries) < 0:
            raise param_error(name, f"max_retries must be >= 0, got {get(self.max_retries)}")
        buffer = get(self.shuffle_buffer_size)
        if buffer is not None and buffer <= 0:
            raise param_error(name, f"shuffle_buffer_size must be a positive number of rows or None, got {buffer}; "
                              "set shuffle=False to turn the shuffle off")
        for param in ("checkpoint_every_steps", "checkpoint_every_seconds"):
            value = get(getattr(self, param)) if self.hasParam(param) else None
            if value is not None and value <= 0:
                raise param_error(name, f"{param} must be positive (or None for epoch checkpoints only), got {value}")
        self._check_elastic()
        self._check_retention()
        features, labels = get(self.feature_cols), get(self.label_cols)
        if not features:
            raise param_error(name, "feature_cols is empty: name the column(s) the model takes as input")
        if not labels:
            raise param_error(name, "label_cols is empty: name the column(s) the model is trained to predict")
        weight_col = get(self.sample_weight_col)
        validation = get(self.validation)
        wanted = [("feature_cols", c) for c in features] + [("label_cols", c) for c in labels]
        if weight_col:
            wanted.append(("sample_weight_col", weight_col))
        if isinstance(validation, str):
            wanted.append(("validation", validation))
        check_columns(df, wanted)
        if len(set(features) | set(labels)) != len(features) + len(labels):
            raise param_error(name, f"a column is both a feature and a label: {sorted(set(features) & set(labels))}")
        model = self._opt(self.model)
        if model is None:
            raise param_error(name, "set model")
        check_not_classes(name, self._framework, model, self._opt(self.optimizer) if self.hasParam("optimizer")
                          else None, self._opt(self.loss) if self.hasParam("loss") else None)
        model_bytes = self._check_model(model)
        self._check_loss(len(labels))
        label_shapes = get(self.label_shapes)
        if label_shapes is not None and len(label_shapes) != len(labels):
            raise param_error(name, f"label_shapes has {len(label_shapes)} shapes for {len(labels)} label columns "
                              f"{list(labels)}; give one per label")
        weights = get(self.loss_weights)
        if weights is not None and len(weights) != len(labels):
            raise param_error(name, f"loss_weights has {len(weights)} entries for {len(labels)} label columns")
        run_id = get(self.run_id) or f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        store.run_path(run_id)  # checks the name
        if get(self.mlflow) is not None:
            try:
                import mlflow  # noqa: F401
            except ImportError as exc:
                raise param_error(name, "mlflow is set but the mlflow package is not installed") from exc
        self._check_label_types(df)
        backend = self._backend(df.sparkSession)
        num_proc = backend.num_processes()  # the one slot check of this fit (classic or Spark Connect)
        store.check_writable()  # a probe write, only once every other check passed
        return {"store": store, "run_id": run_id, "num_proc": num_proc, "model_bytes": model_bytes,
                "backend": backend}

    def _check_rows(self, df: Any, plan: dict) -> None:
        """The rows' checks (``preflight.check_rows``: one Spark job) into ``plan["label_max"]``: for a DataFrame
        that is not prepared (``fit_on_parquet``), or a dataset prepared by a version that did not record them."""
        get = self.getOrDefault
        labels, weight_col = list(get(self.label_cols)), get(self.sample_weight_col)
        plan["label_max"] = check_rows(df, type(self).__name__, list(get(self.feature_cols)) + labels
                                        + ([weight_col] if weight_col else []), labels)

    def _elastic_range(self) -> tuple[int, int | None] | None:
        """``(min_num_proc, max_num_proc)`` of an ``elastic=True`` fit (min default 1; max default num_proc, None
        when that is unset too: the backend takes the session's default parallelism), else None."""
        if not self.hasParam("elastic") or not self.getOrDefault(self.elastic):
            return None
        get = self.getOrDefault
        low, high = get(self.min_num_proc), get(self.max_num_proc)
        return (1 if low is None else low), (high if high is not None else get(self.num_proc))

    def _check_retention(self) -> None:
        """``keep_best_checkpoints`` and ``final_model='best'`` need ``monitor``; a ``val_`` monitor needs
        validation rows; neither goes with a best-epoch policy of the estimator's own (``best_metric``, a Keras
        ``checkpoint_callback`` with ``save_best_only``), which already keeps only improving epochs."""
        name, get = type(self).__name__, self.getOrDefault
        monitor, keep_best, final = get(self.monitor), get(self.keep_best_checkpoints), get(self.final_model)
        wants = [p for p, on in (("keep_best_checkpoints", keep_best is not None), ("final_model='best'",
                                                                                   final == "best")) if on]
        if wants and not monitor:
            raise param_error(name, f"{' and '.join(wants)} rank the checkpoints by monitor: set monitor to a history "
                              "key, e.g. monitor='val_loss'")
        if monitor and monitor.startswith("val_") and get(self.validation) in (None, 0.0):
            raise param_error(name, f"monitor={monitor!r} is a validation metric but validation is not set (no "
                              "validation rows); set validation (e.g. 0.1) or monitor a training key such as 'loss'")
        if wants and self._checkpoint_policy() is not None:
            own = "best_metric" if self.hasParam("best_metric") else "checkpoint_callback (save_best_only)"
            raise param_error(name, f"{' and '.join(wants)} does not go with {own}, which already keeps only "
                              "improving epochs and returns the best; use one of them")

    def _checkpoint_policy(self) -> Any:
        """The estimator's own best-epoch policy (a ``BestPolicy``), if any (default none)."""
        return None

    def _check_elastic(self) -> None:
        """The elastic params, on the driver: ranges, and the options that do not go with ``elastic=True``."""
        if not self.hasParam("elastic"):
            return
        name, get = type(self).__name__, self.getOrDefault
        elastic = get(self.elastic)
        low, high, limit = get(self.min_num_proc), get(self.max_num_proc), get(self.reset_limit)
        if not elastic:
            for param, value in (("min_num_proc", low), ("max_num_proc", high), ("reset_limit", limit)):
                if value is not None:
                    raise param_error(name, f"{param}={value} is set but elastic is False; set elastic=True "
                                      f"(or unset {param})")
            return
        for param, value in (("min_num_proc", low), ("max_num_proc", high)):
            if value is not None and value < 1:
                raise param_error(name, f"{param} must be a positive integer, got {value}")
        if limit is not None and limit < 0:
            raise param_error(name, f"reset_limit must be >= 0 or None (no limit), got {limit}")
        low, high = self._elastic_range()
        if high is not None and low > high:
            raise param_error(name, f"min_num_proc={low} is above max_num_proc={high}")
        num_proc = get(self.num_proc)
        if num_proc is not None and high is not None and not low <= num_proc <= high:
            raise param_error(name, f"num_proc={num_proc} (the first launch's ranks) is outside min_num_proc={low} "
                              f".. max_num_proc={high}")
        if get(self.max_retries):
            raise param_error(name, f"max_retries={get(self.max_retries)} does not go with elastic=True, which "
                              "relaunches on its own after a lost rank; bound the relaunches with reset_limit")

    def _runner_backend(self) -> Any:
        """The runner object given as ``backend`` (Horovod's param: a ``SparkBackend`` or any object with
        ``num_processes()``), or None (also for the Keras estimator's Keras backend name)."""
        if not self.hasParam("backend") or not self.isDefined(self.backend):
            return None
        value = self.getOrDefault(self.backend)
        return None if value is None or isinstance(value, str) else value

    def _backend(self, spark: Any) -> Any:
        """The runner for this fit (``spark_hvd.runner.backend.SparkBackend``): its num_proc, GPU, retry, elastic
        and verbosity settings from the params; num_proc, env, encrypt and start_timeout from a ``backend`` object
        where one is given (Horovod's ``SparkBackend(num_proc, env, ...)`` keeps them in ``_num_proc``/``_env``/
        ``_kwargs``)."""
        from spark_hvd.runner.backend import SparkBackend

        get = self.getOrDefault
        name = type(self).__name__
        elastic = self._elastic_range()
        # the ranks apply the frameworks' quiet log settings (unless their environment has them) before anything
        # is unpickled there: a Keras model imports TensorFlow (runner/start_lines.py)
        from spark_hvd.runner.start_lines import QUIET_ENV

        env: dict[str, str] = {QUIET_ENV: "1"}
        num_proc, encrypt, start_timeout = get(self.num_proc), get(self.encrypt), None
        given = self._runner_backend()
        if given is not None:
            if num_proc is not None:
                raise param_error(name, f"backend and num_proc={num_proc} are both set; set one (the backend's "
                                  "num_processes() is the number of ranks)")
            if elastic is not None:
                raise param_error(name, "backend does not go with elastic=True (set min_num_proc/max_num_proc "
                                  "instead)")
            if isinstance(given, SparkBackend):
                num_proc, their_env, their_encrypt = given._requested, given.env, given.encrypt
                start_timeout = given.start_timeout
            else:  # Horovod's shape
                try:
                    num_proc = int(given.num_processes())
                except Exception as exc:  # noqa: BLE001 - re-raised naming the param
                    raise param_error(name, f"backend.num_processes() failed: {exc}") from exc
                extra = getattr(given, "_kwargs", None) or {}
                their_env = getattr(given, "env", None) or getattr(given, "_env", None)
                their_encrypt = getattr(given, "encrypt", extra.get("encrypt"))
                start_timeout = extra.get("start_timeout")
            env.update({str(k): str(v) for k, v in (their_env or {}).items()})
            if encrypt is None:
                encrypt = their_encrypt
        return SparkBackend(spark, num_proc, use_gpu=get(self.use_gpu), max_retries=get(self.max_retries),
                            verbose=get(self.verbose), elastic=elastic, env=env, start_timeout=start_timeout,
                            reset_limit=get(self.reset_limit) if elastic else None, encrypt=encrypt)

    # ---- fit
    def _fit(self, df: Any) -> BaseModel:
        plan = self._check(df)
        from spark_hvd.runner.progress import phase_line

        verbose = self.getOrDefault(self.verbose)
        phase_line(f"preparing data for {plan['num_proc']} ranks", verbose)
        # the rows' checks (rows, nulls, the labels' largest values) are the preparation's own Spark job, or the
        # committed dataset's record of them: no job of their own
        data = _prepare_data(self, df, plan["store"], plan["num_proc"])
        if "label_max" in data.extra:
            plan["label_max"] = data.extra["label_max"]
        else:
            self._check_rows(df, plan)
        phase_line(f"data {data.key}: {data.train_rows} training + {data.val_rows} validation rows -> "
                   f"{data.num_partitions} files per split", verbose)
        return self._train(df, plan, data)

    def _learning_rate(self) -> float | None:
        """The optimizer's learning rate as given (for the start summary), or None when it has no single one."""
        return None

    def _start_summary(self, plan: dict) -> str:
        """``starting N ranks ...`` with the effective batch and the learning rate, and whether it is scaled."""
        get, n = self.getOrDefault, plan["num_proc"]
        bpps = get(self.backward_passes_per_step)
        batch = get(self.batch_size)
        text = (f"starting {n} ranks (run {plan['run_id']}): batch {batch} per rank x {n} ranks"
                f"{f' x {bpps} passes' if bpps > 1 else ''} = {batch * n * bpps} rows per optimizer step")
        lr = self._learning_rate()
        if lr is not None:
            if get(self.scale_lr_by_num_proc):
                text += f"; learning rate {lr:g} x {n} = {lr * n:g} (scale_lr_by_num_proc)"
            else:
                text += f"; learning rate {lr:g} as given (not scaled by num_proc; Horovod scaled it)"
        return text

    def fit_on_parquet(self, path: str, validation_path: str | None = None) -> BaseModel:
        """Train on Parquet files already at ``path`` (Horovod's name), read in place by the ranks: no copy.

        ``path`` is a directory in the store's filesystem (a path, or a URL of the store's scheme); its
        feature, label and weight columns must already have types the reader takes as ``fit(df)`` prepares them
        (numeric or boolean scalars; ``binary`` / ``string``, decoded by ``transformation_fn`` / ``collate_fn``;
        arrays of numbers of one fixed shape, or 1-D arrays differing in length, padded per batch; no nulls),
        else a ``DataError`` names the column and the type needed (use ``fit(df)``, which prepares a converted
        copy). Validation rows come from ``validation_path`` (leave the
        ``validation`` param unset). Spark ML Vectors, decimals, and Delta tables (whose current files only
        ``delta-spark`` knows; it is not a dependency) go through ``fit(spark.read...)``.
        """
        from pyspark.sql import SparkSession

        from spark_hvd.data.parquet import describe_parquet, store_path

        name, get = type(self).__name__, self.getOrDefault
        validation = get(self.validation)
        if validation not in (None, 0.0):
            raise param_error(name, f"fit_on_parquet takes its validation rows from validation_path; unset "
                              f"validation (it is {validation!r})")
        store = self._opt(self.store)
        if isinstance(store, str):
            from spark_hvd.store import Store

            store = Store.create(store)
        if store is None:
            raise param_error(name, "set store (fit_on_parquet reads path through the store's filesystem)")
        spark = SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()
        df = spark.read.parquet(store.spark_url(store_path(store, path)))
        plan = self._check(df)
        self._check_rows(df, plan)
        data = describe_parquet(plan["store"], path, list(get(self.feature_cols)), list(get(self.label_cols)),
                                get(self.sample_weight_col), validation_path, plan["num_proc"])
        return self._train(df, plan, data)

    def _spec(self, store: Any, run_id: str, data: Any, model_bytes: bytes) -> TrainSpec:
        """What every rank's ``train_on_rank`` receives: this estimator's settings for the run ``run_id`` on the
        dataset ``data`` (prepared, or described in place) in ``store``."""
        get = self.getOrDefault
        return self._spec_class(
            store=store, run_id=run_id, dataset=data, model_bytes=model_bytes,
            feature_cols=tuple(get(self.feature_cols)), label_cols=tuple(get(self.label_cols)),
            sample_weight_col=get(self.sample_weight_col), batch_size=get(self.batch_size),
            val_batch_size=get(self.val_batch_size) or get(self.batch_size), epochs=get(self.epochs),
            train_steps_per_epoch=get(self.train_steps_per_epoch),
            validation_steps_per_epoch=get(self.validation_steps_per_epoch), shuffle=get(self.shuffle),
            random_seed=get(self.random_seed), callbacks=tuple(self._opt(self.callbacks) or ()),
            transformation_fn=self._opt(self.transformation_fn), collate_fn=self._opt(self.collate_fn),
            reader_pool_type=get(self.reader_pool_type), reader_num_workers=get(self.train_reader_num_workers),
            val_reader_num_workers=get(self.val_reader_num_workers), shuffle_buffer_size=get(self.shuffle_buffer_size),
            inmemory_cache_all=get(self.inmemory_cache_all),
            label_shapes=checked_label_shapes(type(self).__name__, get(self.label_shapes), data),
            ragged=get(self.ragged),
            backward_passes_per_step=get(self.backward_passes_per_step),
            gradient_compression=self._opt(self.gradient_compression), use_gpu=get(self.use_gpu),
            mp_start_method=get(self.mp_start_method), verbose=get(self.verbose),
            terminate_on_nan=get(self.terminate_on_nan),
            scale_lr_by_num_proc=get(self.scale_lr_by_num_proc), checkpoint_upload=get(self.checkpoint_upload),
            checkpoint_when_busy=get(self.checkpoint_when_busy), keep_checkpoints=get(self.keep_checkpoints),
            keep_best_checkpoints=get(self.keep_best_checkpoints), final_model=get(self.final_model),
            monitor=BestPolicy.create(get(self.monitor), get(self.monitor_mode)) if get(self.monitor) else None,
            **self._train_spec(),
        )

    def _train(self, df: Any, plan: dict, data: Any) -> BaseModel:
        """The training stage on the dataset ``data`` (prepared, or described in place), then the fitted model."""
        get = self.getOrDefault
        store, run_id, num_proc = plan["store"], plan["run_id"], plan["num_proc"]
        spec = self._spec(store, run_id, data, plan["model_bytes"])
        check_batch_functions_on_driver(spec)
        self._preflight(spec, plan.get("label_max", {}))
        log.info("%s: training run %s on %d processes", type(self).__name__, run_id, num_proc)
        from spark_hvd.runner.progress import phase_line

        verbose = get(self.verbose)
        if verbose:
            done = RunDir(store, run_id).list_checkpoints()
            if done:
                phase_line(f"resuming run {run_id} after epoch {done[-1] + 1} of {get(self.epochs)}", verbose)
            phase_line(self._start_summary(plan), verbose)
        tracking = self._start_mlflow(store, run_id)
        try:
            results = plan["backend"].run(self._rank_fn, args=(self._trainer_class, spec),
                                          on_event=tracking.on_event if tracking else None)
            trained = self._load_trained_model(store, run_id, spec.model_bytes)
        except BaseException as exc:
            if tracking:
                tracking.fail()
            if isinstance(exc, KeyboardInterrupt):  # the runner has stopped the ranks already
                raise _interrupted(type(self).__name__, store, run_id) from None
            raise
        history, output_shapes = results[0]["history"], results[0]["output_shapes"]
        metadata = model_metadata(data, output_shapes)
        if results[0].get("final_epoch") is not None:  # final_model="best": the epoch the model is from
            metadata["final_epoch"] = results[0]["final_epoch"]
        kind = self._classifier_kind() if len(get(self.label_cols)) == 1 else None
        if kind:
            metadata["classifier"] = kind
        model = self._model_class(
            model=trained, feature_cols=list(get(self.feature_cols)), label_cols=list(get(self.label_cols)),
            history=history, run_id=run_id, metadata=metadata, **self._model_params(),
        )
        model.getOrDefault(model.metadata)["ragged"] = get(self.ragged)  # transform hands ragged rows over alike
        for param in ("transformation_fn", "collate_fn"):  # transform preprocesses as training did
            if self._opt(getattr(self, param)) is not None:
                model._set(**{param: self._opt(getattr(self, param))})
        if tracking:
            tracking.finish(model, df, self._log_mlflow_model)
        return model

    def _start_mlflow(self, store: Any, run_id: str) -> Any:
        """With ``mlflow`` set: an open ``MlflowRun`` with the params (and the epochs of the checkpoint this fit
        resumes) logged, whose ``on_event`` logs each epoch's metrics as rank 0 reports them
        (``spark_hvd.estimators.common.mlflow_log``); else None."""
        setting = self.getOrDefault(self.mlflow)
        if setting is None:
            return None
        from spark_hvd.estimators.common.mlflow_log import MlflowRun, mlflow_options

        params = {p.name: v for p, v in self.extractParamMap().items()
                  if p.name not in OBJECT_PARAMS and v is not None}
        params["model_class"] = type(self.getOrDefault(self.model)).__name__
        if self._opt(self.optimizer) is not None:
            params["optimizer"] = type(self.getOrDefault(self.optimizer)).__name__
        with tempfile.TemporaryDirectory() as tmp:
            latest = RunDir(store, run_id).latest_checkpoint(tmp)
        earlier = latest.state.get("history") if latest is not None else None
        return MlflowRun(mlflow_options(setting), run_id).start(params, earlier)


def interrupted_message(name: str, run_id: str, epochs: list[int]) -> str:
    """The one line a Ctrl-C during ``fit`` prints: the run, its last committed checkpoint, how to resume."""
    if not epochs:
        return (f"{name}: interrupted; run {run_id!r} had no checkpoint yet, so fitting again starts it over "
                f"(same run: setRunId({run_id!r}))")
    return (f"{name}: interrupted; run {run_id!r} has a checkpoint after epoch {epochs[-1] + 1}; resume it with "
            f"setRunId({run_id!r}) (or run_id={run_id!r}) and fit again")


def _interrupted(name: str, store: Any, run_id: str) -> KeyboardInterrupt:
    """The ``KeyboardInterrupt`` a Ctrl-C during training ends in: :func:`interrupted_message` as its message and
    ``run_id`` as an attribute (``BaseEstimator.fit`` raises it again, with a traceback of two frames)."""
    try:
        epochs = RunDir(store, run_id).list_checkpoints()
    except Exception:  # noqa: BLE001 - a store that cannot list now: say what is known
        epochs = []
    exc = KeyboardInterrupt(interrupted_message(name, run_id, epochs))
    exc.run_id = run_id  # type: ignore[attr-defined]
    return exc


def _prepare_data(est: BaseEstimator, df: Any, store: Any, num_proc: int) -> Any:
    """``spark_hvd.data.prepare_data`` with the estimator's params; returns its ``DatasetInfo``."""
    from spark_hvd.data.prepare import prepare_data

    get = est.getOrDefault
    validation = get(est.validation)
    if validation == 0.0:
        validation = None
    return prepare_data(
        df, store, feature_cols=list(get(est.feature_cols)), label_cols=list(get(est.label_cols)),
        sample_weight_col=get(est.sample_weight_col), validation=validation, num_proc=num_proc,
        partitions_per_process=get(est.partitions_per_process), seed=get(est.random_seed) or 0,
        overwrite=bool(get(est.overwrite_prepared_data)), sparse_vectors=get(est.sparse_vectors),
    )
