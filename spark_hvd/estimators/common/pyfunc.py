"""A fitted stage as an MLflow pyfunc model: ``<Model>.log_mlflow(...)``.

The pyfunc's ``predict(pandas.DataFrame)`` takes the raw feature columns as ``transform`` takes them (arrays or
lists, Vectors, image bytes, strings, token-id lists) and returns the columns ``transform`` adds: the output
columns, and for a classifier ``prediction`` and ``probability`` (an array of doubles here: a pyfunc has no
Spark ``Vector``). It runs the very function that ``transform``'s ``mapInArrow`` runs on each Arrow batch
(``model._make_transform_fn``: model loading and cache, ``transformation_fn``/``collate_fn``, the reshape of
array columns, the padding of ragged ones, batching, the network, the outputs to Arrow), on an Arrow batch made
from the pandas frame: one code path for both, the classifier columns included (``probability`` as an array of
doubles here, a Vector in ``transform``).

What travels inside the logged model (``artifacts/stage/``): the network's bytes as ``transform`` broadcasts
them, ``stage.json`` (the model class, the feature specs, output columns and shapes, batch size, classifier
kind), the pickled preprocessing functions, and the stage itself (``spark_stage.json``: its class, uid and
JSON params; ``objects/``: its object params' bytes), from which ``<Model>.load_mlflow(uri)`` rebuilds it.
Loading the pyfunc needs spark_hvd and the framework, not Spark (``mlflow.pyfunc.spark_udf`` runs it inside Spark
tasks). The framework's own flavour (``mlflow.pytorch`` /
``mlflow.keras``) is logged beside it in the same run, as ``<name>_network``, for users who want the bare network.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from spark_hvd.estimators.common import compat
from spark_hvd.estimators.common.errors import EstimatorError

__all__ = ["StagePyfunc", "arrays_to_table", "frame_to_table", "load_stage", "log_mlflow", "requirements",
           "save_stage", "stage_from_directory", "tensor_schema"]

log = logging.getLogger(__name__)

#: Rows of the example DataFrame kept as the logged model's input example.
EXAMPLE_ROWS = 5
_STAGE_DIR = "stage"
_SPARK_STAGE = "spark_stage.json"

#: Floors of what the pyfunc needs at load time: the oldest supported runtime's versions (DESIGN.md, Round 4:
#: Databricks 15.4 LTS ML), no upper bounds, so the serving environment keeps the runtime's own frameworks.
_FLOORS = {"numpy": "1.23", "pandas": "1.5", "pyarrow": "14", "cloudpickle": "2.2"}
_FRAMEWORK_FLOORS = {"torch": {"torch": "2.3"}, "keras": {"keras": "3.2", "tensorflow": "2.16"}}


# ------------------------------------------------------------------------------------------------ the bundle


def _framework(stage_cls: type) -> str:
    return "keras" if "keras" in stage_cls.__module__ else "torch"


def requirements(stage: Any) -> list[str]:
    """The pip requirements of the pyfunc, as ranges: spark_hvd (this minor version and up), numpy, pandas,
    pyarrow, cloudpickle, the framework (floors of the oldest supported runtime)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        own = version("spark_hvd")
    except PackageNotFoundError:
        own = "0.1"
    major_minor = ".".join(own.split(".")[:2])
    floors = dict(_FLOORS)
    framework = _framework(type(stage))
    floors.update(_FRAMEWORK_FLOORS[framework])
    if framework == "keras":
        import keras

        if keras.backend.backend() != "tensorflow":
            floors.pop("tensorflow")
    return [f"spark_hvd>={major_minor}"] + [f"{name}>={floor}" for name, floor in floors.items()]


def _example_frame(stage: Any, example: Any, rows: int = EXAMPLE_ROWS) -> Any:
    """The first rows of ``example`` (a Spark or pandas DataFrame) as a pandas DataFrame of the feature columns,
    Vectors as arrays of doubles (how a pyfunc's caller hands them over)."""
    names = [s["name"] for s in stage._feature_specs()]
    if hasattr(example, "sparkSession"):
        from pyspark.ml.functions import vector_to_array
        from pyspark.ml.linalg import VectorUDT

        df = example.select(*[f"`{n}`" for n in names]).limit(rows)
        vectors = {n: vector_to_array(df[n]) for n in names if isinstance(df.schema[n].dataType, VectorUDT)}
        if vectors:
            df = df.withColumns(vectors)
        return _doubles(compat.to_arrow(df).to_pandas())
    missing = [n for n in names if n not in example.columns]
    if missing:
        raise EstimatorError(f"log_mlflow: the example has no feature column(s) {missing}")
    return _doubles(example[names].head(rows).reset_index(drop=True))


def _doubles(frame: Any) -> Any:
    """``frame`` with float32 columns and float32 array cells as float64: the signature then says ``double``,
    which float32 inputs convert to safely, and JSON numbers (a serving request, MLflow's check of the serving
    example) are doubles; the preprocessing casts to the trained dtype as ``transform`` does."""
    frame = frame.copy()
    for c in frame.columns:
        column = frame[c]
        if column.dtype == np.float32:
            frame[c] = column.astype(np.float64)
        elif column.dtype == object and len(column) and isinstance(column.iloc[0], np.ndarray) \
                and column.iloc[0].dtype == np.float32:
            frame[c] = [np.asarray(v, dtype=np.float64) for v in column]
    return frame


def save_stage(stage: Any, directory: str | os.PathLike, example: Any = None) -> dict[str, Any]:
    """Write what the pyfunc needs into ``directory``: ``model.bin`` (the bytes ``transform`` broadcasts),
    ``preprocessing.pkl`` (if any) and ``stage.json``; returns the JSON's content."""
    model = stage.getModel()
    if model is None:
        raise EstimatorError(f"{type(stage).__name__}.log_mlflow: the stage has no model")
    out_cols = stage.getOutputCols()
    if not out_cols:
        raise EstimatorError(f"{type(stage).__name__}.log_mlflow: set label_cols or output_cols")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    data = stage._serialize_model(model)
    (directory / "model.bin").write_bytes(data)
    preprocessing = stage._preprocessing_bytes()
    if preprocessing is not None:
        (directory / "preprocessing.pkl").write_bytes(preprocessing)
    metadata = stage.getOrDefault(stage.metadata) or {}
    shapes = metadata.get("output_shapes")
    specs = stage._feature_specs()
    if not shapes:
        if example is None:
            raise EstimatorError(f"{type(stage).__name__}.log_mlflow: the output shapes are not recorded (a model "
                                 "not made by fit): pass input_example=<a DataFrame of a few rows>")
        from spark_hvd.estimators.common.model import model_inputs

        table = frame_to_table(stage, _example_frame(stage, example, 1))
        inputs = model_inputs(table, list(range(len(specs))), specs, stage._opt(stage.transformation_fn),
                              stage._opt(stage.collate_fn), stage._ragged())
        shapes = [list(np.asarray(o).shape[1:]) for o in stage._predict(stage._load_for_inference(data), inputs)]
    config = {
        "model_class": f"{type(stage).__module__}:{type(stage).__qualname__}",
        "specs": specs,
        "output_cols": list(out_cols),
        "output_shapes": [list(s) for s in shapes],
        "batch_size": int(stage.getOrDefault(stage.batch_size)),
        "ragged": stage._ragged(),
        "classifier": metadata.get("classifier") if len(out_cols) == 1 else None,
        "prediction_col": stage.getOrDefault(stage.prediction_col),
        "probability_col": stage.getOrDefault(stage.probability_col),
    }
    (directory / "stage.json").write_text(json.dumps(config, indent=2) + "\n")
    _save_params(stage, directory)
    return config


def _save_params(stage: Any, directory: Path) -> None:
    """The stage itself beside the pyfunc's files, for :func:`load_stage`: ``spark_stage.json`` (its class, uid
    and JSON params, as Spark ML's metadata has them) and ``objects/<param>`` (its object params' bytes as
    ``save`` writes them; the model's are ``model.bin``)."""
    objects = directory / "objects"
    objects.mkdir(exist_ok=True)
    for name, data in stage._dump_objects(skip=frozenset({"model"})).items():
        (objects / name).write_bytes(data)
    metadata = {"class": f"{type(stage).__module__}.{type(stage).__qualname__}", "uid": stage.uid,
                "paramMap": stage._json_params()}
    (directory / _SPARK_STAGE).write_text(json.dumps(metadata, indent=2) + "\n")


def stage_from_directory(directory: str | os.PathLike, expected: type | None = None) -> Any:
    """The fitted stage (a ``TorchModel``, ``KerasModel`` ...) that :func:`save_stage` wrote into ``directory``,
    checked to be an ``expected`` (default: any spark_hvd model)."""
    from spark_hvd.estimators.common.model import BaseModel
    from spark_hvd.estimators.common.persistence import rebuild_stage

    directory = Path(directory)
    if not (directory / _SPARK_STAGE).exists():
        raise EstimatorError(f"{directory} has no {_SPARK_STAGE}: the model was logged by a spark_hvd without "
                             "load_mlflow; log it again with log_mlflow")
    metadata = json.loads((directory / _SPARK_STAGE).read_text())
    blobs = {p.name: p.read_bytes() for p in (directory / "objects").iterdir()}
    blobs["model"] = (directory / "model.bin").read_bytes()
    return rebuild_stage(metadata, blobs, expected or BaseModel, str(directory))


def load_stage(model_uri: str, expected: type | None = None) -> Any:
    """``<Model>.load_mlflow(model_uri)``: the fitted stage a ``log_mlflow`` pyfunc at ``model_uri`` holds
    (``runs:/...``, ``models:/name/version``, a path), as a Spark ML model again: ``transform`` at its own speed,
    saving into a Pipeline. Raises ``EstimatorError`` where the model is not such a pyfunc."""
    import mlflow.pyfunc

    pyfunc = mlflow.pyfunc.load_model(model_uri)
    inner = pyfunc.unwrap_python_model() if hasattr(pyfunc, "unwrap_python_model") else None
    if not isinstance(inner, StagePyfunc):
        raise EstimatorError(f"{model_uri} is not a model logged by spark_hvd's log_mlflow (its python model: "
                             f"{type(inner).__name__})")
    return stage_from_directory(inner.directory, expected)


# ------------------------------------------------------------------------------------------------ pandas -> Arrow


def _as_list(value: Any) -> Any:
    """One cell of a feature column as Arrow takes it: Vectors and n-d arrays as (nested) lists."""
    if hasattr(value, "toArray"):  # a pyspark.ml.linalg Vector
        return value.toArray().tolist()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def frame_to_table(stage_or_specs: Any, pdf: Any) -> Any:
    """The feature columns of a pandas DataFrame as a pyarrow Table, one column per feature in the stage's order:
    numeric columns as Arrow numbers, arrays / lists / Vectors as Arrow lists, bytes as binary, strings as strings
    (what ``transform``'s ``mapInArrow`` receives for the same Spark columns)."""
    import pyarrow as pa

    specs = stage_or_specs if isinstance(stage_or_specs, list) else stage_or_specs._feature_specs()
    columns = {}
    for s in specs:
        name = s["name"]
        if name not in pdf.columns:
            raise EstimatorError(f"predict: the input has no feature column {name!r} (columns: {list(pdf.columns)})")
        series = pdf[name]
        if series.dtype != object:
            columns[name] = pa.array(series.to_numpy())
            continue
        cells = series.tolist()
        fast = _flat_list_array(cells)
        columns[name] = fast if fast is not None else pa.array([_as_list(v) for v in cells])
    return pa.table(columns)


def _flat_list_array(cells: list) -> Any:
    """Cells that are all 1-D numeric numpy arrays (what ``spark_udf`` and pandas hand over for an array column) as
    one Arrow list array built from their concatenation and offsets: no per-row ``tolist`` (which took 94% of
    ``predict`` for a 64-wide column). Values widen as ``tolist`` would (floats to float64, integers to int64), so
    the column equals the slow path's; None for anything else (lists, Vectors, n-d arrays, None cells)."""
    import pyarrow as pa

    if not cells or not all(type(c) is np.ndarray and c.ndim == 1 for c in cells):
        return None
    kinds = {c.dtype.kind for c in cells}
    if kinds - {"f"} and kinds - {"i", "u"}:  # all floats or all integers
        return None
    flat = np.concatenate(cells).astype(np.float64 if "f" in kinds else np.int64, copy=False)
    offsets = np.zeros(len(cells) + 1, dtype=np.int64)
    np.cumsum([len(c) for c in cells], out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:  # beyond a list array's 32-bit offsets: the slow path
        return None
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(flat))


def tensor_schema(stage_or_specs: Any, example: Any) -> Any:
    """The input schema as MLflow tensors, one named ``TensorSpec`` of shape ``(-1, *row shape)`` per feature
    column, where every feature column of ``example`` (a pandas frame of raw rows) holds floats with one shape per
    row: float scalars, or arrays / lists of floats (declared float64, as JSON numbers and a Vector's doubles
    arrive). None where a column is anything else (bytes, strings, ragged or sparse columns, cells of different
    shapes; integers and booleans too, since MLflow casts a tensor's values to its type, which would truncate a
    float given for an integer silently), which keep MLflow's column schema.

    MLflow checks a tensor column of a pandas frame with one ``np.vstack`` and a reshape (and a cast of list
    cells): a wrong width, a ragged row or a non-numeric cell still fails its check, but the check costs one numpy
    call per batch, where the column schema's ``Array(double)`` costs a pandas Series and a cast per row
    (``mlflow.models.utils._enforce_array``: 84% of a ``spark_udf`` batch, docs/serving.md). ``predict`` then gets
    a dict of 2-D arrays (:func:`arrays_to_table`)."""
    from mlflow.types.schema import Schema, TensorSpec

    specs = stage_or_specs if isinstance(stage_or_specs, list) else stage_or_specs._feature_specs()
    tensors = []
    for s in specs:
        shape = s.get("shape")
        if s.get("kind", "scalar") not in ("scalar", "vector", "array") or (shape and -1 in list(shape)):
            return None
        column = example[s["name"]]
        if column.dtype != object:
            kind, row_shape = column.dtype.kind, ()
        else:
            cells = [np.asarray(v) for v in column]
            shapes = {c.shape for c in cells}
            kinds = {c.dtype.kind for c in cells}
            if len(shapes) != 1 or len(kinds) != 1 or not next(iter(shapes)):
                return None
            kind, row_shape = kinds.pop(), shapes.pop()
        if kind != "f":
            return None
        tensors.append(TensorSpec(np.dtype(np.float64), (-1, *row_shape), s["name"]))
    return Schema(tensors)


def arrays_to_table(stage_or_specs: Any, arrays: dict[str, Any]) -> Any:
    """The feature columns given as arrays of ``(rows, *row shape)`` (what MLflow hands ``predict`` after checking
    a tensor schema) as a pyarrow Table, one column per feature in the stage's order: 1-D arrays as Arrow numbers,
    the others as fixed-size lists of each row's flattened values, without a copy (``transform``'s conversion
    reshapes them to the recorded shape, as it does Spark's list columns)."""
    import pyarrow as pa

    specs = stage_or_specs if isinstance(stage_or_specs, list) else stage_or_specs._feature_specs()
    columns = {}
    for s in specs:
        name = s["name"]
        if name not in arrays:
            raise EstimatorError(f"predict: the input has no feature column {name!r} (inputs: {list(arrays)})")
        value = np.asarray(arrays[name])
        if value.ndim <= 1:
            columns[name] = pa.array(value.reshape(-1))
            continue
        flat = np.ascontiguousarray(value).reshape(len(value), -1)
        columns[name] = pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1])
    return pa.table(columns)


# ------------------------------------------------------------------------------------------------ the pyfunc


class _Shared:
    """Stands in for the broadcast variable ``transform`` hands its function (``.value`` = the model bytes)."""

    def __init__(self, value: bytes) -> None:
        self.value = value


def _python_model_base() -> type:
    try:
        from mlflow.pyfunc import PythonModel
    except ImportError:  # the class is importable without MLflow (the layering test, docs)
        return object
    return PythonModel


class StagePyfunc(_python_model_base()):  # type: ignore[misc]
    """The MLflow ``PythonModel`` of a fitted stage (see the module docstring)."""

    def load_context(self, context: Any) -> None:
        """Read ``artifacts/stage`` and build ``transform``'s per-batch function once."""
        self.load_directory(context.artifacts[_STAGE_DIR])

    def load_directory(self, directory: str | os.PathLike) -> None:
        """Build the predict function from a directory written by :func:`save_stage`."""
        import hashlib

        from spark_hvd.estimators.common.model import _make_transform_fn

        directory = Path(directory)
        self.directory = directory
        config = json.loads((directory / "stage.json").read_text())
        module, _, qualname = config["model_class"].partition(":")
        stage_cls = functools.reduce(getattr, qualname.split("."), importlib.import_module(module))
        data = (directory / "model.bin").read_bytes()
        pre = directory / "preprocessing.pkl"
        specs = config["specs"]
        key = f"pyfunc-{stage_cls.__name__}-{hashlib.sha256(data).hexdigest()[:24]}"
        self.config = config
        kind = config.get("classifier")
        classifier = (kind, config.get("prediction_col") or "", config.get("probability_col") or "", False) \
            if kind else None
        self._fn = _make_transform_fn(stage_cls, key, _Shared(data), specs, list(range(len(specs))), [],
                                      config["output_cols"], config["output_shapes"], config["batch_size"], False,
                                      pre.read_bytes() if pre.exists() else None, config["ragged"], classifier)

    def predict(self, context, model_input, params=None):  # noqa: ANN001, ANN201 - MLflow reads hints as a schema
        """The columns ``transform`` adds for the rows of ``model_input`` (a pandas DataFrame of raw feature
        columns, or a dict of arrays per feature column as MLflow hands them over after checking a tensor
        schema), as a pandas DataFrame with the same index (a new one for a dict)."""
        import pandas as pd
        import pyarrow as pa

        config = self.config
        if isinstance(model_input, dict) and all(isinstance(v, np.ndarray) for v in model_input.values()):
            table = arrays_to_table(config["specs"], model_input)
            index = pd.RangeIndex(table.num_rows)
        else:
            if not isinstance(model_input, pd.DataFrame):
                model_input = pd.DataFrame(model_input)
            table = frame_to_table(config["specs"], model_input)
            index = model_input.index
        batches = table.to_batches() or [pa.RecordBatch.from_pylist([], schema=table.schema)]
        if len(batches) > 1:
            batches = [pa.RecordBatch.from_arrays(table.combine_chunks().columns, names=table.column_names)]
        result = pa.Table.from_batches(list(self._fn(iter(batches))))
        out = result.to_pandas()
        out.index = index
        return out


# ------------------------------------------------------------------------------------------------ logging


def _pyfunc_log_model(python_model: Any, **kwargs: Any) -> Any:
    import mlflow.pyfunc

    return mlflow.pyfunc.log_model(python_model=python_model, **kwargs)


def _log_network(stage: Any, name: str) -> None:
    """The framework flavour beside the pyfunc (``<name>_network``), requirements as ranges."""
    framework = _framework(type(stage))
    reqs = [f"{n}>={v}" for n, v in {**_FRAMEWORK_FLOORS[framework], "cloudpickle": _FLOORS["cloudpickle"]}.items()]
    if framework == "torch":
        import mlflow.pytorch

        compat.log_model(mlflow.pytorch.log_model, stage.getModel(), f"{name}_network",
                         serialization_format="pickle", pip_requirements=reqs)
    else:
        import mlflow.keras

        compat.log_model(mlflow.keras.log_model, stage.getModel(), f"{name}_network", pip_requirements=reqs)


def log_mlflow(stage: Any, name: str = "model", input_example: Any = None, registered_model_name: str | None = None,
               log_network: bool = True, check_input: bool = True, **kwargs: Any) -> Any:
    """``<Model>.log_mlflow``: log ``stage`` as a pyfunc (see the module docstring) in the active MLflow run (one
    is started, and ended, if none is active), with a signature and an input example from ``input_example`` (a
    Spark or pandas DataFrame of raw rows: its first rows), requirements as ranges, registered under
    ``registered_model_name`` if given; the framework flavour beside it (``log_network``). ``check_input=False``
    logs the signature's outputs only, so that MLflow checks no input schema at ``predict`` (its check of an array
    column runs per row, and is most of ``spark_udf``'s time: docs/serving.md); the input example is logged all the
    same. ``kwargs`` go to ``mlflow.pyfunc.log_model``. Returns the pyfunc's ``ModelInfo`` (``.model_uri`` loads
    it)."""
    import mlflow
    from mlflow.models import ModelSignature, infer_signature

    _pyfunc_log_model.__wrapped__ = mlflow.pyfunc.log_model  # compat.log_model reads the pyfunc's keywords
    with tempfile.TemporaryDirectory(prefix="spark_hvd_pyfunc_") as tmp:
        stage_dir = Path(tmp) / _STAGE_DIR
        save_stage(stage, stage_dir, input_example)
        if input_example is not None:
            example = _example_frame(stage, input_example)
            local = StagePyfunc()
            local.load_directory(stage_dir)
            kwargs.setdefault("input_example", example)
            signature = infer_signature(example, local.predict(None, example))
            tensors = tensor_schema(stage, example) if check_input else None
            if not check_input or tensors is not None:  # float columns: MLflow's tensor check, one numpy call
                signature = ModelSignature(inputs=tensors, outputs=signature.outputs)
            kwargs.setdefault("signature", signature)
        if registered_model_name:
            kwargs["registered_model_name"] = registered_model_name
        kwargs.setdefault("pip_requirements", requirements(stage))
        started = mlflow.active_run() is None
        if started:
            mlflow.start_run()
        try:
            info = compat.log_model(_pyfunc_log_model, StagePyfunc(), name,
                                    artifacts={_STAGE_DIR: str(stage_dir)}, **kwargs)
            if log_network:
                _log_network(stage, name)
        finally:
            if started:
                mlflow.end_run()
    return info
