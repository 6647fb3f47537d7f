"""``BaseModel``: the fitted Model of every estimator, and its batched Arrow inference (``transform``).

``transform`` is ``mapInArrow`` over the DataFrame. DESIGN.md measured ``mapInArrow`` 2.6x faster than
``mapInPandas`` for a small MLP (no pandas conversion of the pass-through columns, and list columns stay flat Arrow
buffers that become a 2-D numpy array with one reshape). The model bytes travel once per executor as a broadcast
variable (on Spark Connect, which has none, inside the function's closure) and are deserialised once per Python
worker (a cache keyed by a hash of the bytes).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from pyspark.ml import Model

from spark_hvd.estimators.common import compat
from spark_hvd.estimators.common.arrow import feature_to_numpy, output_spark_type, output_to_arrow
from spark_hvd.estimators.common.errors import param_error
from spark_hvd.estimators.common.persistence import PersistableStage

__all__ = ["BaseModel", "TaskDevice", "choose_gpu", "inference_device", "task_device", "task_gpu_index",
           "task_threads"]

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------------ worker-side cache

_MODEL_CACHE: OrderedDict[str, Any] = OrderedDict()
_MODEL_CACHE_LOCK = threading.Lock()
_MODEL_CACHE_SIZE = 2


def _cached_model(key: str, load: Callable[[], Any]) -> Any:
    """The model for ``key``, loaded at most once per Python worker (the last two models stay cached)."""
    with _MODEL_CACHE_LOCK:
        if key in _MODEL_CACHE:
            _MODEL_CACHE.move_to_end(key)
            return _MODEL_CACHE[key]
        model = load()
        _MODEL_CACHE[key] = model
        while len(_MODEL_CACHE) > _MODEL_CACHE_SIZE:
            _MODEL_CACHE.popitem(last=False)
        return model


# ------------------------------------------------------------------------------------------------ the model


class BaseModel(Model, PersistableStage):
    """A fitted model: ``transform(df)`` adds one prediction column per label (see the module docstring).

    A framework subclass implements ``_serialize_model``/``_deserialize_model`` (classmethods),
    ``_load_for_inference(data) -> model`` (runs on executors; classmethod) and
    ``_predict(model, inputs) -> list of numpy arrays`` (classmethod; one array per label, first dimension = rows).
    """

    def __init__(self) -> None:
        super().__init__()
        self._broadcast: tuple[tuple[str, type], Any] | None = None
        self._shape_cache: dict[tuple, list[list[int]]] = {}
        self._serialized: tuple[str, bytes] | None = None

    # ---- framework hooks
    @classmethod
    def _load_for_inference(cls, data: bytes, use_gpu: bool = False) -> Any:
        return cls._deserialize_model(data)

    @classmethod
    def _predict(cls, model: Any, inputs: list[np.ndarray]) -> list[np.ndarray]:
        raise NotImplementedError

    @classmethod
    def _predict_batches(cls, model: Any, inputs: list[np.ndarray], batch_size: int) -> list[np.ndarray]:
        """The model's outputs for all rows of ``inputs``, calling it on ``batch_size`` rows at a time (a framework
        may override this to convert the inputs once per Arrow batch rather than once per model call)."""
        n = len(inputs[0])
        parts: list[list[np.ndarray]] | None = None
        for start in range(0, n, batch_size) or [0]:
            outs = cls._predict(model, [x[start:start + batch_size] for x in inputs])
            if parts is None:
                parts = [[] for _ in outs]
            if len(outs) != len(parts):
                raise ValueError(f"the model returned {len(outs)} outputs for one batch and {len(parts)} for another")
            for acc, o in zip(parts, outs, strict=True):
                acc.append(np.asarray(o))
        return [p[0] if len(p) == 1 else np.concatenate(p) for p in parts or []]

    def _input_shapes(self) -> list | None:
        return None

    # ---- public API
    def getModel(self) -> Any:  # noqa: N802
        """The trained model (a plain framework model, no distributed wrapper)."""
        return self.getOrDefault(self.model)

    def getHistory(self) -> dict[str, list[float]]:  # noqa: N802
        """Per-epoch metrics averaged over ranks, e.g. ``{"loss": [...], "val_loss": [...]}``."""
        return dict(self.getOrDefault(self.history) or {})

    def _feature_specs(self) -> list[dict]:
        """Per feature column: name, dtype and per-row shape (from the data metadata or input_shapes; None = as is)."""
        cols = self.getOrDefault(self.feature_cols)
        if not cols:
            raise param_error(self, "feature_cols is not set")
        meta = (self.getOrDefault(self.metadata) or {}).get("features") or {}
        shapes = self._input_shapes()
        if shapes is not None and len(shapes) != len(cols):
            raise ValueError(f"input_shapes has {len(shapes)} entries for {len(cols)} feature columns")
        specs = []
        for i, col in enumerate(cols):
            info = meta.get(col, {}) if isinstance(meta, dict) else {}
            shape = shapes[i] if shapes is not None else info.get("shape")
            specs.append({"name": col, "dtype": info.get("dtype"), "shape": shape, "kind": info.get("kind", "scalar")})
        return specs

    def _prepared_input(self, df: Any) -> tuple[Any, list[int], list[int]]:
        """``df`` plus temporary ``array<float>`` copies of its Vector feature columns (but those stored sparse in
        training: Spark hands them over as its Vector struct); (df, feature idx, keep idx)."""
        from pyspark.ml.functions import vector_to_array
        from pyspark.ml.linalg import VectorUDT

        names = df.columns
        specs = self._feature_specs()
        cols = [s["name"] for s in specs]
        missing = [c for c in cols if c not in names]
        if missing:
            raise ValueError(f"feature column(s) {missing} not in the DataFrame (columns: {names})")
        keep = list(range(len(names)))
        extra = {}
        feature_names = []
        kinds = [s.get("kind", "scalar") for s in specs]
        for i, col in enumerate(cols):
            # a Vector stored sparse in training comes as Spark's struct, made CSR / Vectors as training made them
            if isinstance(df.schema[col].dataType, VectorUDT) and kinds[i] != "sparse":
                tmp = f"__spark_hvd_feature_{i}"
                extra[tmp] = vector_to_array(df[col], "float32")
                feature_names.append(tmp)
            else:
                feature_names.append(col)
        if extra:
            df = df.withColumns(extra)
        all_names = df.columns
        return df, [all_names.index(c) for c in feature_names], keep

    def _output_shapes(self, df: Any, key: str, data: bytes, feature_idx: list[int],
                       specs: list[dict]) -> list[list[int]]:
        """Per-row shape of each output: from the fit's metadata, else by running the model on one row here."""
        recorded = (self.getOrDefault(self.metadata) or {}).get("output_shapes")
        if recorded:
            return [list(s) for s in recorded]
        cache_key = (key, json.dumps(specs, sort_keys=True),
                     tuple(df.schema[i].dataType.simpleString() for i in feature_idx))
        if cache_key not in self._shape_cache:  # one Spark job per model and input schema, not per transform
            self._shape_cache[cache_key] = self._infer_output_shapes(df, data, feature_idx, specs)
        return self._shape_cache[cache_key]

    def _infer_output_shapes(self, df: Any, data: bytes, feature_idx: list[int],
                             specs: list[dict]) -> list[list[int]]:
        """Runs the model on the first row of ``df`` on the driver; the per-row shape of each output."""
        rows = compat.to_arrow(df.limit(1))
        if rows.num_rows == 0:
            raise ValueError("cannot infer the output shapes from an empty DataFrame; "
                             "fit the model with the estimator or set metadata={'output_shapes': ...}")
        model = self._load_for_inference(data)
        inputs = model_inputs(rows, feature_idx, specs, self._opt(self.transformation_fn), self._opt(self.collate_fn),
                              self._ragged())
        return [list(np.asarray(o).shape[1:]) for o in self._predict(model, inputs)]

    def _model_fingerprint(self, model: Any) -> str | None:
        """A digest of the model that changes when it does, taken without serialising it (a framework whose bytes
        differ from one serialisation to the next, such as a Keras archive with its save date, needs one); None:
        the digest of the serialised bytes."""
        return None

    def _model_broadcast(self, spark: Any) -> tuple[str, Any, bytes]:
        model = self.getModel()
        digest = self._model_fingerprint(model)
        if digest is not None and self._serialized is not None and self._serialized[0] == digest:
            data = self._serialized[1]  # the same model: the same bytes, broadcast and worker cache entry
        else:
            data = self._serialize_model(model)
            digest = digest or hashlib.sha256(data).hexdigest()
            self._serialized = (digest, data)
        key = f"{type(self).__name__}-{digest[:24]}"
        from spark_hvd.runner.cluster import share

        if self._broadcast is None or self._broadcast[0] != (key, type(spark)):
            self._broadcast = ((key, type(spark)), share(spark, data))  # on Spark Connect: in the closure
        return key, self._broadcast[1], data

    def _ragged(self) -> str:
        """How the training reader handed ragged columns over (``"pad"`` or ``"list"``; from the fit's metadata)."""
        return str((self.getOrDefault(self.metadata) or {}).get("ragged", "pad"))

    def _preprocessing_bytes(self) -> bytes | None:
        """``(transformation_fn, collate_fn)`` pickled by spark_hvd's cloudpickle (which honours
        ``register_pickle_by_value``; pyspark's own copy of cloudpickle, which pickles the mapInArrow function, does
        not see those registrations), or None without preprocessing."""
        fns = (self._opt(self.transformation_fn), self._opt(self.collate_fn))
        if fns == (None, None):
            return None
        from spark_hvd import pickling

        return pickling.dumps(fns)

    def _transform(self, df: Any) -> Any:
        from pyspark.sql.types import StructField, StructType

        if self.getModel() is None:
            raise ValueError(f"{type(self).__name__} has no model")
        batch_size = self.getOrDefault(self.batch_size)
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        out_cols = self.getOutputCols()
        if not out_cols:
            raise ValueError("set label_cols or output_cols: transform adds one output column per label")
        if len(set(out_cols)) != len(out_cols):
            raise ValueError(f"output_cols has duplicate names {out_cols}; give each output its own column")
        clash = [c for c in out_cols if c in df.columns]
        if clash:
            raise ValueError(f"output column(s) {clash} already exist in the DataFrame; choose others with "
                             "setOutputCols")
        specs = self._feature_specs()
        prepared, feature_idx, keep_idx = self._prepared_input(df)
        key, bc, data = self._model_broadcast(df.sparkSession)
        out_shapes = self._output_shapes(prepared, key, data, feature_idx, specs)
        if len(out_shapes) != len(out_cols):
            raise ValueError(f"the model has {len(out_shapes)} outputs but there are {len(out_cols)} output columns "
                             f"{out_cols}")
        schema = StructType(list(df.schema.fields) +
                            [StructField(c, output_spark_type(s), True) for c, s in zip(out_cols, out_shapes,
                                                                                          strict=True)])
        classifier = self._classifier(schema.fieldNames())
        if classifier is not None:
            from pyspark.ml.linalg import VectorUDT
            from pyspark.sql.types import DoubleType

            for name, dtype in zip(classifier[1:3], (DoubleType(), VectorUDT()), strict=True):
                if name:
                    schema.add(StructField(name, dtype, True))
        fn = _make_transform_fn(type(self), key, bc, specs, feature_idx, keep_idx, out_cols, out_shapes, batch_size,
                                bool(self.getOrDefault(self.use_gpu)), self._preprocessing_bytes(), self._ragged(),
                                classifier)
        return prepared.mapInArrow(fn, schema)

    def _classifier(self, columns: list[str]) -> tuple[str, str, str, bool] | None:
        """``(kind, prediction column, probability column, True: as a Vector)`` for a classifier's columns beside
        its single raw output (``classifier.py``; an empty name leaves that one out), or None for another model;
        ``columns``: the names already taken."""
        kind = (self.getOrDefault(self.metadata) or {}).get("classifier")
        if not kind or len(self.getOutputCols()) != 1:
            return None
        names = [self.getOrDefault(self.prediction_col), self.getOrDefault(self.probability_col)]
        clash = [c for c in names if c and c in columns]
        if clash:
            raise param_error(self, f"column(s) {clash} already exist in the DataFrame; choose others with "
                              "setPredictionCol / setProbabilityCol ('' leaves one out)")
        from spark_hvd.estimators.common.classifier import KINDS

        if kind not in KINDS:
            raise param_error(self, f"metadata 'classifier' is {kind!r}; one of {list(KINDS)}")
        return kind, names[0], names[1], True


def _make_transform_fn(model_cls: type, key: str, bc: Any, specs: list[dict], feature_idx: list[int],
                       keep_idx: list[int], out_cols: list[str], out_shapes: list[list[int]],
                       batch_size: int, use_gpu: bool = False, preprocessing: bytes | None = None,
                       ragged: str = "pad", classifier: tuple[str, str, str, bool] | None = None) -> Callable:
    """The ``mapInArrow`` function: picklable, holds no reference to the driver-side stage. ``classifier``
    (``BaseModel._classifier``): the prediction and probability columns of the single output, appended in the same
    pass (``classifier.classifier_arrays``)."""
    extra = [c for c in classifier[1:3] if c] if classifier is not None else []

    def classifier_columns(out: np.ndarray) -> list[Any]:
        from spark_hvd.estimators.common.classifier import classifier_arrays

        kind, prediction_col, probability_col, vector = classifier
        prediction, probability = classifier_arrays(out, kind, vector)
        return [a for c, a in ((prediction_col, prediction), (probability_col, probability)) if c]

    def transform_batches(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        # the GPU Spark gave this task (a reused Python worker runs tasks given different GPUs: one cache entry each)
        choice = task_device(use_gpu)
        model, device = _cached_model(f"{key}-{choice.address}-{choice.ordinal}" if use_gpu else key,
                                      lambda: _load_recording_device(model_cls, bc.value, use_gpu))
        transformation_fn, collate_fn = (None, None)
        if preprocessing is not None:
            from spark_hvd import pickling

            transformation_fn, collate_fn = pickling.loads(preprocessing)
        # what inference_device() reports while this function runs; restored when it ends (exhausted, closed or
        # failed), so an in-process call (the pyfunc's predict) leaves no task device behind in the process
        previous = _swap_task_device([device])  # module functions: this closure travels with copies of its globals
        try:
            names = None
            for rb in batches:
                if names is None:
                    names = [rb.schema.names[i] for i in keep_idx] + out_cols + extra
                n = rb.num_rows
                if n == 0:
                    zeros = [np.zeros((0, *s), np.float32) for s in out_shapes]
                    empty = [output_to_arrow(z, 0) for z in zeros] + (classifier_columns(zeros[0]) if extra else [])
                    yield pa.RecordBatch.from_arrays([rb.column(i) for i in keep_idx] + empty, names=names)
                    continue
                inputs = model_inputs(rb, feature_idx, specs, transformation_fn, collate_fn, ragged)
                outs = model_cls._predict_batches(model, inputs, batch_size)
                if len(outs) != len(out_cols):
                    raise ValueError(f"the model returned {len(outs)} outputs for {len(out_cols)} output columns "
                                     f"{out_cols}")
                outputs = [output_to_arrow(o, n) for o in outs] + (classifier_columns(outs[0]) if extra else [])
                yield pa.RecordBatch.from_arrays([rb.column(i) for i in keep_idx] + outputs, names=names)
        finally:
            _swap_task_device(previous)

    return transform_batches


def model_inputs(rb: Any, feature_idx: list[int], specs: list[dict], transformation_fn: Callable | None = None,
                 collate_fn: Callable | None = None, ragged: str = "pad") -> list[np.ndarray]:
    """The model's inputs for an Arrow batch: its feature columns as training gave them. Without preprocessing,
    one reshape per column (``feature_to_numpy``); with ``transformation_fn`` / ``collate_fn``, the feature
    columns as a pandas DataFrame (named as in training) through the same functions, numeric columns then cast
    as the training reader casts them; ragged columns padded per Arrow batch (``ragged="pad"``, with
    ``<name>_length``) or as one array per row (``"list"``), Vectors stored sparse as a float32 CSR matrix (to
    ``transformation_fn``: as ``pyspark.ml.linalg`` Vectors), as the training reader handed them over."""
    numeric = ("scalar", "vector", "array")
    if transformation_fn is None and collate_fn is None and all(s.get("kind", "scalar") in numeric for s in specs):
        return [feature_to_numpy(rb.column(i), s["name"], s["dtype"], s["shape"])
                for i, s in zip(feature_idx, specs, strict=True)]
    import pyarrow as pa

    from spark_hvd.data.columns import arrow_kind, frame_to_batch, pad_ragged, sparse_to_csr, table_to_frame

    table = pa.table({s["name"]: rb.column(i) for i, s in zip(feature_idx, specs, strict=True)})
    if transformation_fn is not None:
        batch = frame_to_batch(transformation_fn(table_to_frame(table)), "transform")
    else:
        batch = {}
        for s in specs:
            name, kind = s["name"], s.get("kind", "scalar")
            if kind in numeric:
                batch[name] = feature_to_numpy(table.column(name), name, s["dtype"], s["shape"])
                continue
            if kind == "sparse":  # training handed collate_fn a float32 CSR matrix
                column = table.column(name)
                if arrow_kind(column.type) == "sparse":  # Spark's Vector struct, as stored in training
                    batch[name] = sparse_to_csr(column.combine_chunks(), tuple(s["shape"] or ()))
                else:  # arrays in the DataFrame at inference
                    import scipy.sparse

                    dense = feature_to_numpy(column, name, "float32", s["shape"])
                    batch[name] = scipy.sparse.csr_matrix(dense)
                continue
            values = table.column(name).combine_chunks().to_numpy(zero_copy_only=False)
            if kind == "ragged" and ragged == "pad":  # as the training reader pads a batch
                batch[name], batch[f"{name}_length"] = pad_ragged(values)
            else:
                batch[name] = values
    if collate_fn is not None:
        batch = collate_fn(batch)
    inputs = []
    for s in specs:
        if s["name"] not in batch:
            raise ValueError(f"transform: the preprocessing returned no feature column {s['name']!r} "
                             f"(it returned {sorted(batch)})")
        value = batch[s["name"]]
        cast = numeric + (("ragged",) if ragged == "pad" and transformation_fn is None and collate_fn is None else ())
        if s.get("kind", "scalar") in cast and s["dtype"] and hasattr(value, "astype"):
            value = value.astype(s["dtype"], copy=False)
        inputs.append(value)
    return inputs


def task_threads() -> int | None:
    """Threads for inference in this Spark task: the task's CPUs (the tasks of an executor share its cores);
    None outside a task."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    return max(1, int(ctx.cpus())) if ctx is not None else None


# ------------------------------------------------------------------------------------------------ the task's device

# The address of the GPU Spark assigned to the task, for a helper process that loads the model for it (it has no
# TaskContext: ``FreshKerasModel``).
TASK_GPU_ENV = "SPARK_HVD_TASK_GPU_ADDRESS"


@dataclass(frozen=True)
class TaskDevice:
    """Where an inference task runs its model. ``address``: the GPU address Spark assigned to the task
    (``TaskContext.resources()["gpu"]``; None: none); ``visible``: this process's ``CUDA_VISIBLE_DEVICES``;
    ``ordinal``: the CUDA ordinal chosen for it (None: ``use_gpu`` off); ``device``: where the model was loaded,
    ``"cuda:N"`` or ``"cpu"`` (``"elsewhere"``: placed by a helper process or a Keras backend); ``note``: why."""

    address: str | None
    visible: str | None
    ordinal: int | None
    device: str
    note: str


def choose_gpu(use_gpu: bool, address: str | None, visible: str | None) -> TaskDevice:
    """The CUDA ordinal for a task Spark gave the GPU ``address``, in a process whose ``CUDA_VISIBLE_DEVICES`` is
    ``visible``: the address's position in that list (a cluster manager that isolates GPUs lists the task's), or the
    address itself where the variable is unset (``device`` is then ``"cuda"``, made ``"cuda:N"`` or ``"cpu"`` by
    ``task_gpu_index`` once the framework's devices are known); without an address
    (``spark.task.resource.gpu.amount`` unset) or with one that is not listed, device 0 of the visible ones
    (``note`` says so; ``task_gpu_index`` warns)."""
    if not use_gpu:
        return TaskDevice(address, visible, None, "cpu", "use_gpu is off")
    listed = [v.strip() for v in visible.split(",") if v.strip()] if visible is not None else None
    if address is not None:
        if listed is not None and address in listed:
            return TaskDevice(address, visible, listed.index(address), "cuda", "the task's GPU")
        if listed is None and address.isdigit():
            return TaskDevice(address, visible, int(address), "cuda", "the task's GPU")
        why = (f"Spark assigned GPU {address!r} to the task but CUDA_VISIBLE_DEVICES={visible!r} does not list it"
               if listed is not None else f"Spark assigned GPU {address!r}, not a device index")
    else:
        why = ("Spark assigned no GPU to the task (set spark.executor.resource.gpu.amount and "
               "spark.task.resource.gpu.amount, with a discovery script)")
    where = f"device 0 of CUDA_VISIBLE_DEVICES={visible}" if listed else "device 0"
    return TaskDevice(address, visible, 0, "cuda", f"{why}: transform uses {where}")


def task_device(use_gpu: bool) -> TaskDevice:
    """``choose_gpu`` for the running Spark task (its ``resources()["gpu"]``; in a helper process, the address in
    ``SPARK_HVD_TASK_GPU_ADDRESS``) and this process's ``CUDA_VISIBLE_DEVICES``; no CUDA device is touched."""
    from pyspark import TaskContext

    from spark_hvd.runner.barrier_task import assigned_gpu

    ctx = TaskContext.get()
    address = assigned_gpu(ctx) if ctx is not None else os.environ.get(TASK_GPU_ENV) or None
    return choose_gpu(use_gpu, address, os.environ.get("CUDA_VISIBLE_DEVICES"))


_WARNED: set[str] = set()
_LOADED_DEVICE: list[TaskDevice] = []  # what the last task_gpu_index call of this process chose
_TASK_DEVICE: list[TaskDevice] = []  # the device of the transform task running in this Python worker


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning(message)


def task_gpu_index(use_gpu: bool, device_count: int) -> int | None:
    """The CUDA ordinal an inference task loads its model on (``task_device``), given the ``device_count`` GPUs the
    framework sees here; None (the CPU) without ``use_gpu`` or where that ordinal is not visible (warned once per
    Python worker, as is a fallback to device 0: an ordinal beyond ``device_count`` takes device 0). The choice is
    what ``inference_device()`` reports."""
    choice = task_device(use_gpu)
    if choice.ordinal is not None and device_count <= 0:
        _warn_once(f"use_gpu is set but this worker sees no GPU ({choice.note}; Spark's address "
                   f"{choice.address!r}): transform runs on the CPU")
        choice = replace(choice, device="cpu", note=f"{choice.note}; no GPU visible: the CPU")
    elif choice.ordinal is not None and choice.ordinal >= device_count:
        note = (f"Spark assigned GPU {choice.address!r} to the task, CUDA device {choice.ordinal}, but this worker "
                f"sees {device_count} GPU(s): transform uses device 0")
        _warn_once(note)
        choice = replace(choice, ordinal=0, device="cuda:0", note=note)
    elif choice.ordinal is not None:
        if choice.note != "the task's GPU":
            _warn_once(choice.note)
        choice = replace(choice, device=f"cuda:{choice.ordinal}")
    _LOADED_DEVICE[:] = [choice]
    return int(choice.device.split(":")[1]) if choice.device.startswith("cuda:") else None


def _load_recording_device(model_cls: type, data: bytes, use_gpu: bool) -> tuple[Any, TaskDevice]:
    """The model loaded for inference and the device its framework put it on (``task_gpu_index``'s choice; a
    framework that does not call it, or a model served by a helper process: the CPU, or ``task_device``'s choice
    marked as decided elsewhere)."""
    _LOADED_DEVICE.clear()
    model = model_cls._load_for_inference(data, use_gpu)
    if _LOADED_DEVICE:
        return model, _LOADED_DEVICE[0]
    choice = task_device(use_gpu)
    if not use_gpu:
        return model, choice
    return model, replace(choice, device="elsewhere", note=f"{choice.note}; placed by the framework or a helper "
                          "process")


def _swap_task_device(devices: list[TaskDevice]) -> list[TaskDevice]:
    """Make ``devices`` (one or none) what ``inference_device()`` reports; returns what it reported before."""
    previous = list(_TASK_DEVICE)
    _TASK_DEVICE[:] = devices
    return previous


def inference_device() -> TaskDevice | None:
    """The device of the ``transform`` task running in this Python worker (None outside one): what Spark assigned,
    and where the model runs. A model's own code (its ``forward``) may read it."""
    return _TASK_DEVICE[0] if _TASK_DEVICE else None
