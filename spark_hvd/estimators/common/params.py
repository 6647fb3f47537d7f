"""Spark ML Params shared by the estimators and their models: those all of them take (``EstimatorParams``,
``ModelParams``), and mixins for those several take (``InputShapesParams``, ``RunnerBackendParams``,
``LossConstructorsParams``, ``StepCheckpointParams``, ``ElasticParams``); each framework's own are in its
``params.py`` (``spark_hvd.estimators.torch.params`` ...). A Horovod param that no estimator here takes is in
``HOROVOD_ONLY`` with what to use instead (the unknown-param error says it).

Every Param has a snake_case name (Horovod's names, so ``TorchEstimator(batch_size=64)`` works as in Horovod), a
type converter, a doc string and, where sensible, a default. Each Params class gets camelCase accessors
(``setBatchSize`` / ``getBatchSize``) generated from its Params, so the estimators behave like any ``pyspark.ml``
stage: ``explainParams()``, ``copy()``, ``extractParamMap()``. A framework's ``params.py`` declares its own with the
same tools: ``_p`` (a Param), the converters (``_to_optional``, ``_to_strict_int``, ``_to_choice`` ...) and the
``@_add_accessors`` decorator.

Params whose values are plain JSON (numbers, strings, lists) are saved in the stage's ``metadata`` by the writer;
the others (model, optimizer, loss, callbacks, store ...) are listed in ``OBJECT_PARAMS`` and saved as pickles.
"""

from __future__ import annotations

from typing import Any

from pyspark.ml.param import Param, Params, TypeConverters

from spark_hvd.estimators.common.spec import LOSS_NAMES

__all__ = [
    "KeywordParams",
    "EstimatorParams",
    "ModelParams",
    "InputShapesParams",
    "RunnerBackendParams",
    "LossConstructorsParams",
    "StepCheckpointParams",
    "ElasticParams",
    "OBJECT_PARAMS",
    "LOSS_NAMES",
]

#: Params whose values are Python objects (not JSON): saved with cloudpickle, or as framework bytes (``model``).
OBJECT_PARAMS = frozenset(
    {
        "model",
        "optimizer",
        "loss",
        "metrics",
        "custom_objects",
        "store",
        "callbacks",
        "checkpoint_callback",
        "train_minibatch_fn",
        "transformation_fn",
        "collate_fn",
        "gradient_compression",
        "lr_scheduler",
        "logger",
        "profiler",
        "trainer_args",
        "loss_constructors",
    }
)

#: Loss names every estimator accepts (the Keras estimator also accepts any Keras loss name).


# --------------------------------------------------------------------------------------------------- converters
def _to_list_string(value: Any) -> list[str]:
    """A column name or a list of column names -> list of str."""
    if isinstance(value, str):
        return [value]
    return TypeConverters.toListString(value)


def _to_optional(conv):
    def convert(value: Any) -> Any:
        return None if value is None else conv(value)

    convert.__name__ = f"optional_{getattr(conv, '__name__', 'value')}"
    return convert


def _to_strict_int(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError(f"expected an int, got the bool {value!r}")
    return TypeConverters.toInt(value)


def _to_validation(value: Any) -> float | str | None:
    """``None``, a fraction in [0, 1) of the rows held out, or the name of a boolean/int column marking them."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        raise TypeError("validation must be a fraction in [0, 1) or a column name, not a bool")
    fraction = float(value)
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"validation fraction must be in [0, 1), got {value!r}")
    return fraction


def _per_row_shapes(name: str, what: str, value: Any) -> list[list[int]] | None:
    """Per-row shapes, one per ``what``; Horovod's form with the batch dimension first (``[[-1, 1, 28, 28]]``) is
    taken too: a leading -1 (or None) is dropped, as these params have no batch dimension."""
    if value is None:
        return None
    shapes = []
    for shape in value:
        dims = [shape] if isinstance(shape, int) else list(shape)
        if len(dims) > 1 and dims[0] in (-1, None):
            dims = dims[1:]  # Horovod's shapes include the batch dimension
        if any(d is None or int(d) < 1 for d in dims):
            raise ValueError(f"{name}: {dims if isinstance(shape, int) else list(shape)} has an unknown or "
                             f"non-positive dimension; give each {what}'s shape per row without the batch "
                             "dimension, e.g. [[1, 28, 28]] (Horovod's [[-1, 1, 28, 28]] is taken too)")
        shapes.append([int(d) for d in dims])
    return shapes


def _to_input_shapes(value: Any) -> list[list[int]] | None:
    """Each model input's per-row shape (Horovod's form with the batch dimension first is taken too)."""
    return _per_row_shapes("input_shapes", "input", value)


def _to_label_shapes(value: Any) -> list[list[int]] | None:
    """Each label's per-row shape (Horovod's form with the batch dimension first is taken too)."""
    return _per_row_shapes("label_shapes", "label", value)


def _to_runner_backend(value: Any) -> Any:
    """None, or a runner with Horovod's backend shape: ``spark_hvd.runner.SparkBackend`` or any object with a
    ``num_processes()`` method (Horovod's ``SparkBackend``)."""
    if value is None or callable(getattr(value, "num_processes", None)):
        return value
    raise TypeError(f"backend must be a spark_hvd.runner.SparkBackend (or an object with num_processes(), as "
                    f"Horovod's SparkBackend), got {type(value).__name__}; or leave it unset and set num_proc")


def _to_loss_constructors(value: Any) -> list | None:
    """None, or a list of zero-argument callables (one per label) that build the losses on every rank."""
    if value is None:
        return None
    fns = list(value) if isinstance(value, list | tuple) else [value]
    bad = [i for i, fn in enumerate(fns) if not callable(fn)]
    if bad or not fns:
        raise TypeError(f"loss_constructors must be a non-empty list of zero-argument callables that build a loss, "
                        f"entry {bad[0] if bad else 0} is not callable")
    return fns


def _to_mlflow(value: Any) -> str | dict | None:
    """``None``/``False``: off; ``True``: the active experiment; a string: that experiment's name; a dict
    ``{"experiment": ..., "registered_model_name": ...}`` (see ``spark_hvd.estimators.common.mlflow_log``)."""
    if value is None or value is False:
        return None
    if value is True:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        from spark_hvd.estimators.common.mlflow_log import mlflow_options

        mlflow_options(value)  # checks the keys
        return dict(value)
    raise TypeError(f"mlflow must be None, a bool, an experiment name or a dict, got {type(value).__name__}")


def _to_json_dict(value: Any) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"expected a dict, got {type(value).__name__}")
    return value


_identity = TypeConverters.identity


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def _add_accessors(cls: type) -> type:
    """Give ``cls`` a ``getX``/``setX`` pair for each Param it declares itself (unless it defines them already)."""
    for attr, param in list(vars(cls).items()):
        if not isinstance(param, Param):
            continue
        camel = _camel(attr)

        def getter(self, _name=attr):
            return self.getOrDefault(getattr(self, _name))

        def setter(self, value, _name=attr):
            return self._set(**{_name: value})

        getter.__name__, setter.__name__ = f"get{camel}", f"set{camel}"
        getter.__doc__ = f"Gets the value of ``{attr}``: {param.doc}"
        setter.__doc__ = f"Sets the value of ``{attr}`` and returns ``self``: {param.doc}"
        if f"get{camel}" not in vars(cls):
            setattr(cls, f"get{camel}", getter)
        if f"set{camel}" not in vars(cls):
            setattr(cls, f"set{camel}", setter)
    return cls


def _p(name: str, doc: str, conv=_identity) -> Param:
    return Param(Params._dummy(), name, doc, typeConverter=conv)


def _to_choice(*choices: str):
    def convert(value: Any) -> str:
        value = TypeConverters.toString(value)
        if value not in choices:
            raise ValueError(f"expected one of {list(choices)}, got {value!r}")
        return value

    convert.__name__ = "one_of_" + "_".join(choices)
    return convert


class KeywordParams(Params):
    """Mixin: ``Cls(**params)`` and ``setParams(**params)`` for every Param the class declares (declared once, in
    the Params classes below, instead of a keyword signature repeated per class). An unknown name is a
    ``TypeError`` that suggests the nearest Param names."""

    def __init__(self, **params: Any) -> None:
        super().__init__()
        self.setParams(**params)

    def setParams(self, **params: Any) -> Any:  # noqa: N802 (Spark ML naming)
        """Sets params by keyword and returns ``self``."""
        import difflib

        for name in params:
            if not self.hasParam(name):
                known = [p.name for p in self.params]
                near = difflib.get_close_matches(name, known, n=3)
                hint = f"; did you mean {near}?" if near else ""
                if name in HOROVOD_ONLY:
                    hint = f" (a Horovod param: {HOROVOD_ONLY[name]}; see docs/migrating-from-horovod.md)"
                raise TypeError(f"{type(self).__name__} has no param {name!r}{hint}")
        return self._set(**params)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.__signature__ = _KeywordSignature()  # help(TorchEstimator) and IDEs that inspect at run time


class _KeywordSignature:
    """``cls.__signature__``: the keyword-only params with their defaults, built on first use (a throwaway
    instance holds the defaults) so ``help()``, ``inspect.signature`` and notebook completion show them."""

    def __get__(self, obj: Any, cls: type) -> Any:
        import inspect

        if obj is not None:  # an instance has no call signature of its own (pyspark's Params walk every attribute)
            return None
        cached = cls.__dict__.get("_keyword_signature")
        if cached is None:
            if cls.__dict__.get("_keyword_signature_busy"):  # Params.__init__ walks every attribute of cls
                return None
            cls._keyword_signature_busy = True
            try:
                probe = cls()
                params = [inspect.Parameter(p.name, inspect.Parameter.KEYWORD_ONLY,
                                            default=probe.getOrDefault(p) if probe.hasDefault(p) else None)
                          for p in sorted(probe.params, key=lambda p: p.name)]
            finally:
                cls._keyword_signature_busy = False
            cached = inspect.Signature(params)
            cls._keyword_signature = cached
        return cached


#: params of Horovod's estimators that spark_hvd does not take, and what to do instead (each one is in the param
#: table of docs/migrating-from-horovod.md)
HOROVOD_ONLY = {
    "continuous_cols": "list every input column in feature_cols",
    "categorical_cols": "list every input column in feature_cols (index strings with StringIndexer first)",
    "compress_sparse_cols": "sparse Vectors are stored dense unless sparse_vectors='sparse'; nothing to set",
    "transformation_edit_fields": "transformation_fn returns the columns it changes; no field list is needed",
    "transformation_removed_fields": "transformation_fn returns the columns it keeps; no field list is needed",
    "feature_columns": "the param is feature_cols",
    "label_columns": "the param is label_cols",
    "data_module": "spark_hvd reads the prepared Parquet with its own reader, not a petastorm DataModule; "
                   "per-batch preprocessing goes in transformation_fn (pandas) or collate_fn (arrays)",
    "backend_env": "pass env to the backend: backend=spark_hvd.runner.SparkBackend(spark, num_proc, env={...})",
    "tensorflow_dataset_prefetch_buffer_size": "the rank's reader reads ahead on its own (train_reader_num_workers "
                                               "row groups at once); there is no tf.data pipeline to tune",
    "loader_num_epochs": "the reader makes exactly one pass per epoch; set train_steps_per_epoch for more or "
                         "fewer steps",
    "debug_data_loader": "set verbose=2",
    "train_async_data_loader_queue_size": "the reader reads ahead on a thread; its depth is "
                                          "train_reader_num_workers",
    "val_async_data_loader_queue_size": "the reader reads ahead on a thread; its depth is val_reader_num_workers",
    "loss_constructors": "a LightningModule computes its loss in training_step (the torch and Keras estimators "
                         "take loss_constructors)",
    "train_minibatch_fn": "a LightningModule's training_step is the step (the torch estimator takes "
                          "train_minibatch_fn)",
}


# --------------------------------------------------------------------------------------------------- mixins
# A param more than one estimator takes (but not all: those are in EstimatorParams) is declared once, in a mixin
# below, with its default; an estimator's Params class lists the mixins it takes before EstimatorParams. To add
# such a param: put it in the mixin of its idea (or a new mixin, decorated with @_add_accessors, whose __init__
# calls super().__init__() then sets its defaults), then add the mixin to the estimators that take it.


@_add_accessors
class InputShapesParams(Params):
    """``input_shapes``: the per-row shape of each model input (torch modules, LightningModules, their models)."""

    input_shapes = _p("input_shapes", "shape of each model input without the batch dimension, e.g. [[1, 28, 28]]",
                      _to_input_shapes)

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(input_shapes=None)


@_add_accessors
class RunnerBackendParams(Params):
    """``backend``: Horovod's runner object (torch and Lightning estimators; the Keras estimator's ``backend`` takes
    either this or Keras's backend name)."""

    backend = _p("backend", "a spark_hvd.runner.SparkBackend (or Horovod's: any object with num_processes()) whose "
                 "num_proc, env, encrypt and start_timeout the fit runs with; not with num_proc set; default None "
                 "(a SparkBackend from num_proc). Not saved with the estimator", _to_runner_backend)

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(backend=None)


@_add_accessors
class LossConstructorsParams(Params):
    """``loss_constructors``: losses built on every rank (torch and Keras), for losses that do not pickle."""

    loss_constructors = _p("loss_constructors", "instead of loss: a list of zero-argument callables, one per label, "
                           "each returning the loss (called on every rank, and once on the driver for the checks), "
                           "for losses that do not pickle", _to_loss_constructors)


@_add_accessors
class StepCheckpointParams(Params):
    """Checkpoints inside an epoch, by steps or by seconds (``spark_hvd.estimators.common.step_checkpoint``)."""

    checkpoint_every_steps = _p("checkpoint_every_steps", "also checkpoint every this many optimizer steps inside "
                                "an epoch; a resume continues at the exact batch (reader position, running sums "
                                "and every rank's random state are in the checkpoint); default None (epochs only)",
                                _to_optional(_to_strict_int))
    checkpoint_every_seconds = _p("checkpoint_every_seconds", "also checkpoint inside an epoch when this many "
                                  "seconds passed since the last one (rank 0's clock); default None",
                                  _to_optional(TypeConverters.toFloat))

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(checkpoint_every_steps=None, checkpoint_every_seconds=None)


@_add_accessors
class ElasticParams(Params):
    """Elastic training on ``spark_hvd.runner.run_elastic``: how many ranks, how many relaunches."""

    elastic = _p("elastic", "train on spark_hvd.runner.run_elastic: a lost rank or executor relaunches the job on "
                 "the task slots that are free (min_num_proc .. max_num_proc ranks), resuming from the last "
                 "checkpoint (set checkpoint_every_steps to lose at most that many steps); default False",
                 TypeConverters.toBoolean)
    min_num_proc = _p("min_num_proc", "elastic=True: the fewest ranks training goes on with (default 1)",
                      _to_optional(_to_strict_int))
    max_num_proc = _p("max_num_proc", "elastic=True: the most ranks (default num_proc)", _to_optional(_to_strict_int))
    reset_limit = _p("reset_limit", "elastic=True: the most relaunches after lost ranks; default None (no limit, "
                     "as Horovod's)", _to_optional(_to_strict_int))

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(elastic=False, min_num_proc=None, max_num_proc=None, reset_limit=None)


# --------------------------------------------------------------------------------------------------- estimators
@_add_accessors
class EstimatorParams(Params):
    """Params every estimator takes (Horovod's ``EstimatorParams`` names)."""

    num_proc = _p("num_proc", "number of training processes (one per Spark task slot); default: all slots",
                  _to_optional(_to_strict_int))
    model = _p("model", "the model to train (a torch.nn.Module or a Keras 3 model)")
    optimizer = _p("optimizer", "optimizer: an instance built on the model (rebuilt on every rank), or a Keras name")
    loss = _p("loss", "loss: a callable, a name (mse, cross_entropy, bce_with_logits, l1) or a list, one per label")
    loss_weights = _p("loss_weights", "weight of each label's loss in the total (one per label)",
                      _to_optional(TypeConverters.toListFloat))
    metrics = _p("metrics", "metrics computed per epoch on train and validation data: callables or names")
    feature_cols = _p("feature_cols", "feature column names, one model input each", _to_optional(_to_list_string))
    label_cols = _p("label_cols", "label column names, one model output each", _to_optional(_to_list_string))
    sample_weight_col = _p("sample_weight_col", "optional column of per-row loss weights",
                           _to_optional(TypeConverters.toString))
    validation = _p("validation", "fraction of rows held out for validation, or a column marking them", _to_validation)
    batch_size = _p("batch_size", "rows per training batch on each process", _to_strict_int)
    val_batch_size = _p("val_batch_size", "rows per validation batch; default: batch_size",
                        _to_optional(_to_strict_int))
    epochs = _p("epochs", "number of passes over the training data", _to_strict_int)
    train_steps_per_epoch = _p("train_steps_per_epoch", "batches per epoch on each process; default: the shard size",
                               _to_optional(_to_strict_int))
    validation_steps_per_epoch = _p("validation_steps_per_epoch",
                                    "validation batches per epoch on each process; default: the whole shard",
                                    _to_optional(_to_strict_int))
    shuffle = _p("shuffle", "shuffle row groups and rows of the training data every epoch", TypeConverters.toBoolean)
    random_seed = _p("random_seed", "seed of the shuffling and of the model's random state on every rank",
                     _to_optional(_to_strict_int))
    store = _p("store", "spark_hvd.store.Store (or a URL) for prepared data, checkpoints, logs and the final model")
    run_id = _p("run_id", "name of this run under runs/ in the store; an earlier run's id resumes it",
                _to_optional(TypeConverters.toString))
    callbacks = _p("callbacks", "list of callbacks run on every rank during training")
    transformation_fn = _p("transformation_fn", "fn(pandas.DataFrame) -> pandas.DataFrame run on the ranks on the "
                           "rows of every batch, after the shuffle (decoding: binary columns arrive as bytes, "
                           "strings as str; e.g. spark_hvd.data.decode.ImageDecoder); also applied by the fitted "
                           "model's transform")
    collate_fn = _p("collate_fn", "fn(batch: dict of numpy arrays) -> dict, run on each batch on the reader's thread "
                    "(tokenising, padding); also applied by the fitted model's transform to each feature batch")
    sparse_vectors = _p("sparse_vectors", "'dense' (default): Vector columns stored and handed over as dense float32 "
                        "arrays; 'sparse': kept sparse, handed to collate_fn as scipy.sparse.csr_matrix "
                        "batches and to transformation_fn as the DataFrame's own Vectors (in transform too)",
                        _to_choice("dense", "sparse"))
    ragged = _p("ragged", "'pad' (default): arrays of varying length (token ids) padded per batch to its longest "
                "row, with a <name>_length column; 'list': one array per row, for collate_fn",
                _to_choice("pad", "list"))
    reader_pool_type = _p("reader_pool_type", "'auto' (default), 'thread' or 'process': the pool that "
                          "transforms batches on each rank (transformation_fn runs there); 'auto': processes for "
                          "a transformation_fn with prefers_processes true (ImageDecoder up to 128x128), else threads",
                          _to_choice("auto", "thread", "process"))
    train_reader_num_workers = _p("train_reader_num_workers", "workers of that pool per rank, each holding one "
                                  "batch at a time; default min(4, CPUs)", _to_optional(_to_strict_int))
    val_reader_num_workers = _p("val_reader_num_workers", "the same for the validation reader; default: "
                                "train_reader_num_workers", _to_optional(_to_strict_int))
    shuffle_buffer_size = _p("shuffle_buffer_size", "rows the training shuffle mixes at once on each rank (the "
                             "reader's bounded shuffle buffer); default None: the shard, at most 65536 rows and about "
                             "256 MB of them; set shuffle=False to turn the shuffle off",
                             _to_optional(_to_strict_int))
    inmemory_cache_all = _p("inmemory_cache_all", "keep each rank's shard (train and validation rows as read from the "
                            "store, before transformation_fn) in memory after the first epoch: later epochs read "
                            "nothing from the store and shuffle and batch the same rows as without it; default False",
                            TypeConverters.toBoolean)
    label_shapes = _p("label_shapes", "each label's shape per row, e.g. [[2, 2]] (Horovod's [[-1, 2, 2]] is taken "
                      "too): the rank reshapes every label batch to it; the sizes are checked on the driver; default "
                      "None (as stored)", _to_label_shapes)
    encrypt = _p("encrypt", "encrypt the ranks' collective traffic (spark_hvd.runner.SparkBackend's encrypt); "
                 "default None: the runner's default", _to_optional(TypeConverters.toBoolean))
    backward_passes_per_step = _p("backward_passes_per_step", "local gradient accumulation steps per allreduce",
                                  _to_strict_int)
    gradient_compression = _p("gradient_compression",
                              "gradient compression (spark_hvd Compression.none / .fp16); default none")
    use_gpu = _p("use_gpu", "train on GPUs where the Spark tasks have them; default: when available",
                 _to_optional(TypeConverters.toBoolean))
    mp_start_method = _p("mp_start_method", "the rank's multiprocessing start method during the fit (Horovod's): "
                         "'fork', 'spawn' or 'forkserver', for processes the user's code starts (torch DataLoader "
                         "workers, pools in callbacks); the reader's own workers always use forkserver; default "
                         "None (Python's)", _to_optional(_to_choice("fork", "spawn", "forkserver")))
    partitions_per_process = _p("partitions_per_process", "Parquet row groups written per training process",
                                _to_strict_int)
    verbose = _p("verbose", "0: quiet, 1: progress per epoch, 2: more", _to_strict_int)
    mlflow = _p("mlflow", "log params, per-epoch metrics (live) and the model to MLflow: None (off), True (active "
                "experiment), an experiment name, or {'experiment': ..., 'registered_model_name': ...}", _to_mlflow)
    max_retries = _p("max_retries", "times the whole training stage is restarted (from the last checkpoint) after a "
                     "rank fails", _to_strict_int)
    terminate_on_nan = _p("terminate_on_nan", "stop with an error naming the epoch and step when the training loss "
                          "is not finite", TypeConverters.toBoolean)
    scale_lr_by_num_proc = _p("scale_lr_by_num_proc", "multiply the optimizer's learning rate by num_proc on every "
                              "rank, as Horovod's estimators always did (default False: the rate is used as given)",
                              TypeConverters.toBoolean)
    checkpoint_upload = _p("checkpoint_upload", "'async' (default): a checkpoint is snapshotted to the rank's local "
                           "disk and uploaded to the store in the background while training goes on; 'sync': "
                           "training waits for each upload", _to_choice("async", "sync"))
    keep_checkpoints = _p("keep_checkpoints", "keep only the newest this many epoch checkpoints of the run (older "
                          "ones are deleted once a newer one is committed); default None: keep all",
                          _to_optional(_to_strict_int))
    keep_best_checkpoints = _p("keep_best_checkpoints", "also keep the best this many epoch checkpoints by monitor "
                               "(beside the newest keep_checkpoints, default then 1); default None",
                               _to_optional(_to_strict_int))
    monitor = _p("monitor", "the history key (e.g. val_loss) that ranks the checkpoints for keep_best_checkpoints "
                 "and final_model='best'", _to_optional(TypeConverters.toString))
    monitor_mode = _p("monitor_mode", "'min', 'max' or 'auto' (max for accuracy-like names) for monitor",
                      _to_choice("auto", "min", "max"))
    final_model = _p("final_model", "the model fit returns: 'last' (default: the weights after the last epoch) or "
                     "'best' (the kept epoch checkpoint best by monitor)", _to_choice("last", "best"))
    checkpoint_when_busy = _p("checkpoint_when_busy", "when a checkpoint is due while the previous one is still "
                              "uploading: 'wait' for it (default) or 'skip' this one", _to_choice("wait", "skip"))
    overwrite_prepared_data = _p("overwrite_prepared_data", "prepare the DataFrame's Parquet again even when the "
                                 "store holds a preparation of the same plan and settings (the cache key cannot see "
                                 "rewritten files under an unchanged plan: set it for a nightly job on a rewritten "
                                 "path)", TypeConverters.toBoolean)

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(
            num_proc=None, loss_weights=None, feature_cols=None, label_cols=None, sample_weight_col=None,
            validation=None, batch_size=32, val_batch_size=None, epochs=1, train_steps_per_epoch=None,
            validation_steps_per_epoch=None, shuffle=True, random_seed=None, run_id=None, backward_passes_per_step=1,
            use_gpu=None, partitions_per_process=10, verbose=1, mlflow=None, max_retries=0, terminate_on_nan=True,
            overwrite_prepared_data=False, scale_lr_by_num_proc=False, checkpoint_upload="async",
            checkpoint_when_busy="wait", keep_checkpoints=None, keep_best_checkpoints=None, monitor=None,
            monitor_mode="auto", final_model="last", reader_pool_type="auto",
            train_reader_num_workers=None, sparse_vectors="dense", ragged="pad", val_reader_num_workers=None,
            shuffle_buffer_size=None, inmemory_cache_all=False, label_shapes=None, encrypt=None,
            mp_start_method=None,
        )

    # Horovod's accessor names where they differ from the generated ones
    def getInMemoryCacheAll(self) -> bool:  # noqa: N802 (Horovod's name)
        """Horovod's name for ``getInmemoryCacheAll``."""
        return self.getOrDefault(self.inmemory_cache_all)

    def setInMemoryCacheAll(self, value: bool) -> Any:  # noqa: N802 (Horovod's name)
        """Horovod's name for ``setInmemoryCacheAll``."""
        return self._set(inmemory_cache_all=value)

    def getShufflingBufferSize(self) -> int | None:  # noqa: N802 (Horovod's name)
        """Horovod's name for ``getShuffleBufferSize``."""
        return self.getOrDefault(self.shuffle_buffer_size)

    def setShufflingBufferSize(self, value: int | None) -> Any:  # noqa: N802 (Horovod's name)
        """Horovod's name for ``setShuffleBufferSize``."""
        return self._set(shuffle_buffer_size=value)

    def getValReaderNumWorker(self) -> int | None:  # noqa: N802 (Horovod's name)
        """Horovod's name for ``getValReaderNumWorkers``."""
        return self.getOrDefault(self.val_reader_num_workers)

    def setValReaderNumWorker(self, value: int | None) -> Any:  # noqa: N802 (Horovod's name)
        """Horovod's name for ``setValReaderNumWorkers``."""
        return self._set(val_reader_num_workers=value)


# --------------------------------------------------------------------------------------------------- models
@_add_accessors
class ModelParams(Params):
    """Params every fitted model takes (``TorchModel``, ``KerasModel``, ``LightningModel``)."""

    model = _p("model", "the trained model")
    feature_cols = _p("feature_cols", "feature column names, one model input each", _to_optional(_to_list_string))
    label_cols = _p("label_cols", "label column names the model was trained on (they need not be in transform's "
                    "input)", _to_optional(_to_list_string))
    output_cols = _p("output_cols", "prediction column names, one per label; default <label>__output",
                     _to_optional(_to_list_string))
    batch_size = _p("batch_size", "rows per inference batch in transform", _to_strict_int)
    history = _p("history", "per-epoch metrics averaged over ranks: {name: [value per epoch]}", _to_json_dict)
    run_id = _p("run_id", "the run in the store that produced this model", _to_optional(TypeConverters.toString))
    metadata = _p("metadata", "column metadata of the training data (dtypes, shapes) used to shape inputs/outputs",
                  _to_json_dict)
    use_gpu = _p("use_gpu", "run transform on the executor's GPU where the task has one (its Spark GPU resource, "
                 "else the first visible CUDA device); the CPU otherwise", TypeConverters.toBoolean)
    transformation_fn = _p("transformation_fn", "the preprocessing transform applies to the raw feature columns "
                           "(a pandas DataFrame of them) before the model; fit sets the estimator's")
    collate_fn = _p("collate_fn", "the per-batch hook transform applies to the feature arrays (a dict by column) "
                    "after transformation_fn; fit sets the estimator's")
    prediction_col = _p("prediction_col", "classifiers (one label, class-index or binary loss): the column of the "
                        "predicted class as a double, as Spark's classifiers; '' to leave it out",
                        TypeConverters.toString)
    probability_col = _p("probability_col", "classifiers: the column of class probabilities as a Vector "
                         "(softmax or sigmoid of logits); '' to leave it out", TypeConverters.toString)

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(feature_cols=None, label_cols=None, output_cols=None, batch_size=1024, history=None,
                         run_id=None, metadata=None, use_gpu=False, transformation_fn=None, collate_fn=None,
                         prediction_col="prediction", probability_col="probability")

    def getOutputCols(self) -> list[str]:  # noqa: N802 (Spark ML naming)
        """The prediction column names: ``output_cols`` if set, else ``<label>__output`` for every label."""
        cols = self.getOrDefault(self.output_cols)
        if cols:
            return list(cols)
        return [f"{label}__output" for label in (self.getOrDefault(self.label_cols) or [])]

    def getFeatureColumns(self) -> list[str] | None:  # noqa: N802 (Horovod's name)
        """Horovod's name for ``getFeatureCols``."""
        return self.getOrDefault(self.feature_cols)

    def getLabelColumns(self) -> list[str] | None:  # noqa: N802 (Horovod's name)
        """Horovod's name for ``getLabelCols``."""
        return self.getOrDefault(self.label_cols)


