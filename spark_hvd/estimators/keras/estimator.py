"""``KerasEstimator`` and ``KerasModel``: what differs for Keras 3 (the rest is in ``common/``: ``fit.py``,
``model.py``, ``params.py``; the rank half is ``keras/rank.py``). Works on Keras's TensorFlow, torch and JAX
backends (the ``backend`` param; ``keras/backend.py``).

The model travels (to the ranks, to the executors for ``transform``, into saved Pipelines) as the bytes of its
``.keras`` file together with the ``custom_objects`` needed to load it (cloudpickled, so classes defined in a notebook
travel by value). The optimizer travels as its class and ``get_config()`` (or a Keras name such as ``"adam"``) and is
rebuilt on every rank, then wrapped in ``spark_hvd.keras.DistributedOptimizer``.
"""

from __future__ import annotations

import logging
from typing import Any

import cloudpickle
import numpy as np

from spark_hvd import pickling
from spark_hvd.estimators.common import compat
from spark_hvd.estimators.common.errors import param_error, param_type_error
from spark_hvd.estimators.common.fit import BaseEstimator
from spark_hvd.estimators.common.mlflow_stage import MlflowStage
from spark_hvd.estimators.common.model import BaseModel
from spark_hvd.estimators.common.params import KeywordParams
from spark_hvd.estimators.common.spec import BestPolicy
from spark_hvd.estimators.keras.backend import FreshKerasModel, load_for_inference, resolve_backend
from spark_hvd.estimators.keras.inference import predict
from spark_hvd.estimators.keras.params import KerasEstimatorParams, KerasModelParams
from spark_hvd.estimators.keras.rank import KerasTrainer, train_keras_rank
from spark_hvd.estimators.keras.serde import (
    MODEL_FILE,
    build_optimizer,
    deserialize_keras_model,
    known_name,
    load_keras_bytes,
    optimizer_spec,
    serialize_keras_model,
)
from spark_hvd.estimators.keras.spec import KerasSpec
from spark_hvd.store.run_dir import RunDir

__all__ = ["KerasEstimator", "KerasModel", "serialize_keras_model", "deserialize_keras_model"]

log = logging.getLogger(__name__)

#: metric names Keras resolves at compile time from the loss (not through ``keras.metrics.get``)
_COMPILE_METRIC_NAMES = ("accuracy", "acc", "crossentropy", "ce")


# ------------------------------------------------------------------------------------------------ the model


class _KerasModelBytes:
    """The model as ``.keras`` bytes (with the ``custom_objects`` of the stage), for the estimator and the model."""

    def _keras_backend_name(self) -> str | None:
        """``backend`` when it names Keras's backend; None when unset or a runner object (Horovod's param)."""
        value = self.getOrDefault(self.backend)
        return value if isinstance(value, str) else None

    def _custom_objects(self) -> dict:
        return dict(self._opt(self.custom_objects) or {})

    def _serialize_model(self, model: Any) -> bytes:  # uses the stage's custom_objects and backend
        return serialize_keras_model(model, self._custom_objects(), self._keras_backend_name())

    def _deserialize_model(self, data: bytes) -> Any:
        return deserialize_keras_model(data, compile=False)

    def _model_fingerprint(self, model: Any) -> str | None:
        """Config, weights and custom object names (a ``.keras`` archive records its save time, so its bytes
        differ on every save: hashing them would reload the model in every worker on every transform)."""
        import hashlib
        import json

        try:
            digest = hashlib.sha256(json.dumps(model.get_config(), sort_keys=True, default=str).encode())
        except Exception:  # noqa: BLE001 - a subclassed model without get_config: hash the archive instead
            return None
        digest.update(repr((sorted(self._custom_objects()), self._keras_backend_name())).encode())
        for w in model.get_weights():
            digest.update(str((w.shape, w.dtype)).encode())
            digest.update(np.ascontiguousarray(w).tobytes())
        return digest.hexdigest()


class KerasModel(KeywordParams, _KerasModelBytes, MlflowStage, BaseModel, KerasModelParams):
    """A trained Keras 3 model as a Spark ML ``Model``.

    ``transform(df)`` calls the model (one ``tf.function``) on batches of ``batch_size`` rows, one array per feature
    column (Vector and array columns as ``(rows, size)`` float32, or ``(rows, *shape)`` as recorded at fit time;
    scalar columns as ``(rows,)``), and adds one column per label: ``<label>__output`` by default
    (``setOutputCols``), a double where the model gives one value per row and an ``array<float>`` otherwise.
    The model is loaded once per Python worker, on Keras's ``backend`` (fit sets the estimator's; in a Python
    worker whose Keras runs on another backend, it is loaded and run in a helper process).
    """

    @classmethod
    def _load_for_inference(cls, data: bytes, use_gpu: bool = False) -> Any:
        return load_for_inference(data, use_gpu)

    @classmethod
    def _predict(cls, model: Any, inputs: list[np.ndarray]) -> list[np.ndarray]:
        if isinstance(model, FreshKerasModel):
            return model.predict(inputs)
        return predict(model, inputs)

    def export(self, path: str, format: str = "saved_model", example: Any = None, verify: bool = True,  # noqa: A002
               **kwargs: Any) -> dict[str, Any]:
        """Write the model to the directory ``path`` as ``format`` ``"saved_model"``, ``"keras"`` or ``"onnx"``
        (where tf2onnx can), with its input and output names and shapes in ``spark_hvd_export.json`` beside it
        (the batch dimension open); ``verify`` loads the artifact back and compares it with the model. See
        ``estimators/torch/export.py``."""
        from spark_hvd.estimators.keras.export import export_keras

        return export_keras(self, path, format, example=example, verify=verify, **kwargs)


# ------------------------------------------------------------------------------------------------ loss, metrics


def check_losses(loss: Any, n_labels: int) -> None:
    """``loss`` fits ``n_labels`` labels: one Keras loss (name, ``Loss`` or callable) or a list with one per label."""
    import keras

    if loss is None:
        raise param_error("KerasEstimator", "set loss: a Keras loss name ('mse', 'sparse_categorical_crossentropy', "
                          "...), a keras.losses.Loss or a callable, or a list with one per label")
    if isinstance(loss, dict):
        raise param_type_error("KerasEstimator", "give loss as a list in label_cols order, not a dict")
    losses = list(loss) if isinstance(loss, list | tuple) else [loss]
    if isinstance(loss, list | tuple) and len(losses) != n_labels:
        raise param_error("KerasEstimator", f"{len(losses)} losses for {n_labels} label columns; give one loss per "
                          "label (or a single loss for all of them)")
    for i, item in enumerate(losses):
        if isinstance(item, str):
            if not known_name(keras.losses.get, item):
                raise param_error("KerasEstimator", f"unknown loss name {item!r} (label {i}); use a Keras loss name, "
                                  "a keras.losses.Loss or a callable")
        elif not callable(item):
            raise param_error("KerasEstimator", f"loss {i} is a {type(item).__name__}, not a Keras loss or a name")


def check_metrics(metrics: list) -> None:
    """Every metric is a Keras metric name, a ``Metric`` or a callable (lists per output allowed)."""
    import keras

    for m in metrics:
        items = m if isinstance(m, list | tuple) else [m]
        for item in items:
            if isinstance(item, str):
                if item not in _COMPILE_METRIC_NAMES and not known_name(keras.metrics.get, item):
                    raise param_error("KerasEstimator", f"unknown metric name {item!r}; use a Keras metric name, a "
                                      "keras.metrics.Metric or a callable")
            elif not callable(item):
                raise param_error("KerasEstimator", f"metric {item!r} is not a Keras metric, a callable or a name")


def _model_output_count(model: Any) -> int | None:
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):
        return None
    return len(outputs) if outputs is not None else None


# ------------------------------------------------------------------------------------------------ the estimator


class KerasEstimator(KeywordParams, _KerasModelBytes, BaseEstimator, KerasEstimatorParams):
    """Data-parallel training of a Keras 3 model (TensorFlow, torch or JAX backend) on a DataFrame -> ``KerasModel``.

    Example::

        model = keras.Sequential([keras.Input(shape=(64,)), keras.layers.Dense(10, activation="softmax")])
        est = KerasEstimator(num_proc=2, store=Store.create("/tmp/store"), model=model,
                             optimizer=keras.optimizers.Adam(learning_rate=1e-3),
                             loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                             feature_cols=["features"], label_cols=["label"], batch_size=64, epochs=5,
                             validation=0.1)
        fitted = est.fit(train_df)         # or Pipeline(stages=[assembler, est]).fit(train_df)

    The model gets one input per feature column (a list for several) and gives one output per label, in
    ``label_cols`` order. On every rank ``model.fit`` runs on the rank's shard of the prepared data
    (``spark_hvd.data.keras_loader.KerasBatchDataset``), compiled with the optimizer rebuilt from its config and
    wrapped in ``spark_hvd.keras.DistributedOptimizer``, ``loss``, ``loss_weights`` and ``metrics`` (Keras names
    or objects; a flat metric list applies to every output). Callbacks on every rank, in this order:
    ``BroadcastGlobalVariablesCallback(0)``, ``MetricAverageCallback()`` (so what follows sees metrics averaged
    over ranks), the user's ``callbacks``, then the checkpointing of rank 0 and the progress reports.

    The learning rate is used as given: gradients are averaged over ranks, so the effective batch is
    ``num_proc * batch_size``; to keep the per-example step of a single-process run, scale the rate yourself
    (often by ``num_proc``) and consider ``spark_hvd.keras.callbacks.LearningRateWarmupCallback`` in ``callbacks``.

    Checkpoints: after every epoch rank 0 commits ``model.keras`` (with the optimizer) and the optimizer's
    variables to ``runs/<run_id>/checkpoints/epoch-<e>``. ``checkpoint_callback`` (a
    ``keras.callbacks.ModelCheckpoint``) may restrict this to improvements of its ``monitor`` (``save_best_only``;
    its ``filepath`` is not used); the final model is then the best checkpoint. A fit with the ``run_id`` of an
    earlier run, or a retry (``max_retries``) after a failed rank, continues after the newest checkpoint.
    """

    _model_class = KerasModel
    _framework = "keras"

    def _learning_rate(self) -> float | None:
        try:
            return float(self._opt(self.optimizer).learning_rate)  # a schedule or an optimizer name: no number
        except Exception:  # noqa: BLE001 - only the start summary's number is lost
            return None

    def _classifier_kind(self) -> str | None:
        from spark_hvd.estimators.common.classifier import keras_kind

        return keras_kind(self._loss_value())
    _spec_class = KerasSpec
    _trainer_class = KerasTrainer
    _rank_fn = staticmethod(train_keras_rank)

    # ---- persistence: the optimizer as its spec (the model: _KerasModelBytes)
    def _dump_object(self, name: str, value: Any) -> bytes:
        if name == "optimizer":
            return pickling.dumps(optimizer_spec(value))
        return super()._dump_object(name, value)

    def _load_objects(self, blobs: dict[str, bytes]) -> dict[str, Any]:
        spec = blobs.pop("optimizer", None)
        out = super()._load_objects(blobs)
        if spec is not None:
            spec = cloudpickle.loads(spec)
            out["optimizer"] = spec["name"] if "name" in spec else build_optimizer(spec)
            self._set(optimizer=out["optimizer"])
        return out

    # ---- framework hooks of BaseEstimator
    def _check_model(self, model: Any) -> bytes:
        self._keras_backend = resolve_backend(self._keras_backend_name())
        data = serialize_keras_model(model, self._custom_objects())
        self._optimizer_spec = optimizer_spec(self._opt(self.optimizer))
        n_labels = len(self.getOrDefault(self.label_cols))
        n_out = _model_output_count(model)
        if n_out is not None and n_out != n_labels:
            raise param_error("KerasEstimator", f"the model has {n_out} outputs for {n_labels} label columns "
                              f"{self.getOrDefault(self.label_cols)}; give one label column per output")
        cb = self._opt(self.checkpoint_callback)
        if cb is not None:
            import keras

            if not isinstance(cb, keras.callbacks.ModelCheckpoint):
                raise param_type_error("KerasEstimator",
                                       f"checkpoint_callback must be a keras.callbacks.ModelCheckpoint, "
                                       f"got {type(cb).__name__}")
        return data

    def _preflight(self, spec: Any, label_max: dict[str, float]) -> None:
        from spark_hvd.estimators.keras.preflight import keras_forward_check

        keras_forward_check(type(self).__name__, spec, label_max)

    def _backend(self, spark: Any) -> Any:
        """The runner, with ``KERAS_BACKEND`` set on the ranks (before their Python imports Keras)."""
        runner = super()._backend(spark)
        runner.env = {**(runner.env or {}), "KERAS_BACKEND": self._keras_backend}
        return runner

    def _check_loss(self, n_labels: int) -> None:
        if self._opt(self.loss) is not None and self._opt(self.loss_constructors) is not None:
            raise param_error("KerasEstimator", "loss and loss_constructors are both set; set one")
        check_losses(self._loss_value(), n_labels)
        check_metrics(self._metrics())

    @staticmethod
    def _is_class_index_loss(loss: Any) -> bool:
        import keras

        return loss in ("sparse_categorical_crossentropy", keras.losses.sparse_categorical_crossentropy) or \
            isinstance(loss, keras.losses.SparseCategoricalCrossentropy)

    def _checkpoint_policy(self) -> BestPolicy | None:
        cb = self._opt(self.checkpoint_callback)
        if cb is None or not cb.save_best_only:
            return None
        from spark_hvd._keras_common import compat as keras_compat

        return BestPolicy.create(cb.monitor, *keras_compat.checkpoint_mode(cb))

    def _train_spec(self) -> dict:
        return {
            "optimizer": self._optimizer_spec,
            "loss": self._opt(self.loss),
            "loss_constructors": tuple(self._opt(self.loss_constructors) or ()),
            "loss_weights": self.getOrDefault(self.loss_weights),
            "metrics": tuple(self._metrics()),
            "best": self._checkpoint_policy(),
            "backend": self._keras_backend,
            "checkpoint_every_steps": self.getOrDefault(self.checkpoint_every_steps),
            "checkpoint_every_seconds": self.getOrDefault(self.checkpoint_every_seconds),
            "elastic": self.getOrDefault(self.elastic),
        }

    def _load_trained_model(self, store: Any, run_id: str, model_bytes: bytes) -> Any:
        data = RunDir(store, run_id).read_model_file(MODEL_FILE)
        return load_keras_bytes(data, self._custom_objects(), compile=True)

    def _model_params(self) -> dict:
        return {"custom_objects": self._custom_objects(), "backend": self._keras_backend}

    def _log_mlflow_model(self, model: Any, **kwargs: Any) -> None:
        import keras
        import mlflow.keras

        reqs = [f"keras=={keras.__version__}", f"cloudpickle=={cloudpickle.__version__}"]
        try:
            import tensorflow as tf

            reqs.append(f"tensorflow=={tf.__version__}")
        except ImportError:
            pass
        # explicit requirements: MLflow's inference of them loads the model in a subprocess (slow). No input
        # example: mlflow.keras.save_model (3.17) writes it before it creates the model's directory and fails.
        kwargs.pop("input_example", None)
        compat.log_model(mlflow.keras.log_model, model, "model", pip_requirements=reqs, **kwargs)
