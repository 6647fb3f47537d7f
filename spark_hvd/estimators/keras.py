"""``KerasEstimator`` and ``KerasModel``: what differs for Keras 3 (the rest is in ``fit.py``, ``model.py``,
``params.py``; the rank half is ``keras_rank.py``). Works on Keras's TensorFlow and torch backends.

The model travels (to the ranks, to the executors for ``transform``, into saved Pipelines) as the bytes of its
``.keras`` file together with the ``custom_objects`` needed to load it (cloudpickled, so classes defined in a notebook
travel by value). The optimizer travels as its class and ``get_config()`` (or a Keras name such as ``"adam"``) and is
rebuilt on every rank, then wrapped in ``spark_hvd.keras.DistributedOptimizer``.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from typing import Any

import cloudpickle
import numpy as np

from spark_hvd import pickling
from spark_hvd.estimators.fit import BaseEstimator
from spark_hvd.estimators.keras_rank import MODEL_FILE as _MODEL_FILE
from spark_hvd.estimators.keras_rank import KerasTrainer, set_threads
from spark_hvd.estimators.model import BaseModel, task_gpu_index, task_threads
from spark_hvd.estimators.params import KerasEstimatorParams, KerasModelParams, KeywordParams
from spark_hvd.estimators.rank_data import RunFiles
from spark_hvd.estimators.spec import BestPolicy, KerasSpec

__all__ = ["KerasEstimator", "KerasModel", "serialize_keras_model", "deserialize_keras_model"]

log = logging.getLogger(__name__)

#: metric names Keras resolves at compile time from the loss (not through ``keras.metrics.get``)
_COMPILE_METRIC_NAMES = ("accuracy", "acc", "crossentropy", "ce")


# ------------------------------------------------------------------------------------------------ model bytes


def serialize_keras_model(model: Any, custom_objects: dict | None = None) -> bytes:
    """A built Keras 3 model -> bytes: its ``.keras`` file plus ``custom_objects`` (cloudpickle envelope)."""
    import keras

    if not isinstance(model, keras.Model):
        kind = type(model).__module__ + "." + type(model).__name__
        hint = " (a tf.keras / tf_keras model of Keras 2? build it with `import keras`, Keras 3)" \
            if "keras" in kind else ""
        raise TypeError(f"model must be a Keras 3 keras.Model, got {kind}{hint}")
    if not model.built:
        raise ValueError("the Keras model is not built: give it an input shape (keras.Input(shape=...) or "
                         "model.build((None, ...))) before passing it to KerasEstimator")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, _MODEL_FILE)
        try:
            model.save(path)
        except Exception as exc:  # noqa: BLE001 - re-raised with what to do
            raise TypeError(f"the Keras model cannot be saved as .keras: {exc}. Custom layers need get_config(); "
                            "pass them in custom_objects") from exc
        with open(path, "rb") as f:
            data = f.read()
    try:
        objects = pickling.dumps(dict(custom_objects or {}))
    except Exception as exc:  # noqa: BLE001
        raise TypeError(f"custom_objects cannot be pickled: {exc}") from exc
    return cloudpickle.dumps({"format": "keras", "keras": data, "custom_objects": objects})


def _unpack(data: bytes) -> tuple[bytes, dict]:
    env = cloudpickle.loads(data)
    if not isinstance(env, dict) or env.get("format") != "keras":
        raise ValueError("these bytes are not a model serialised by spark_hvd.estimators.keras")
    return env["keras"], cloudpickle.loads(env["custom_objects"])


def load_keras_bytes(keras_bytes: bytes, custom_objects: dict, compile: bool = False) -> Any:  # noqa: A002
    """The model in the bytes of a ``.keras`` file (``compile=True``: with its optimizer, loss and metrics if they
    can be rebuilt, e.g. no unregistered custom loss; falls back to an uncompiled model, with a warning)."""
    import keras

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, _MODEL_FILE)
        with open(path, "wb") as f:
            f.write(keras_bytes)
        # safe_mode=False: Lambda layers load too; these bytes come from the user's own estimator (as do the pickles)
        if compile:
            try:
                return keras.saving.load_model(path, custom_objects=custom_objects or None, safe_mode=False)
            except Exception as exc:  # noqa: BLE001 - the weights still load; say why it is not compiled
                log.warning("Keras model loaded without its compile state (%s: %s)", type(exc).__name__, exc)
        return keras.saving.load_model(path, custom_objects=custom_objects or None, compile=False, safe_mode=False)


def deserialize_keras_model(data: bytes, compile: bool = False) -> Any:  # noqa: A002 - Keras's name
    """The inverse of :func:`serialize_keras_model`: a plain Keras model (``compile``: see ``load_keras_bytes``)."""
    return load_keras_bytes(*_unpack(data), compile=compile)


# ------------------------------------------------------------------------------------------------ the model


class _KerasModelBytes:
    """The model as ``.keras`` bytes (with the ``custom_objects`` of the stage), for the estimator and the model."""

    def _custom_objects(self) -> dict:
        return dict(self._opt(self.custom_objects) or {})

    def _serialize_model(self, model: Any) -> bytes:  # uses the stage's custom_objects
        return serialize_keras_model(model, self._custom_objects())

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
        digest.update(repr(sorted(self._custom_objects())).encode())
        for w in model.get_weights():
            digest.update(str((w.shape, w.dtype)).encode())
            digest.update(np.ascontiguousarray(w).tobytes())
        return digest.hexdigest()


class KerasModel(KeywordParams, _KerasModelBytes, BaseModel, KerasModelParams):
    """A trained Keras 3 model as a Spark ML ``Model``.

    ``transform(df)`` calls the model (one ``tf.function``) on batches of ``batch_size`` rows, one array per feature
    column (Vector and array columns as ``(rows, size)`` float32, or ``(rows, *shape)`` as recorded at fit time;
    scalar columns as ``(rows,)``), and adds one column per label: ``<label>__output`` by default
    (``setOutputCols``), a double where the model gives one value per row and an ``array<float>`` otherwise.
    The model is loaded once per Python worker.
    """


    @classmethod
    def _load_for_inference(cls, data: bytes, use_gpu: bool = False) -> Any:
        import keras

        threads = task_threads()
        if threads is not None:
            set_threads(threads, inter_op=1)
        model = deserialize_keras_model(data, compile=False)
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            index = task_gpu_index(use_gpu, len(tf.config.list_physical_devices("GPU")))
            _INFERENCE_DEVICES[id(model)] = (model, "/CPU:0" if index is None else f"/GPU:{index}")
            while len(_INFERENCE_DEVICES) > 2:  # as many as the worker's model cache keeps
                _INFERENCE_DEVICES.pop(next(iter(_INFERENCE_DEVICES)))
        return model

    @classmethod
    def _predict(cls, model: Any, inputs: list[np.ndarray]) -> list[np.ndarray]:
        x = inputs[0] if len(inputs) == 1 else list(inputs)
        fn = _inference_fn(model, x)
        out = fn(x) if fn is not None else model.predict_on_batch(x)
        if isinstance(out, dict):
            out = [out[name] for name in model.output_names]
        if not isinstance(out, list | tuple):
            out = [out]
        return [np.asarray(o) for o in out]


_INFERENCE_FNS: dict[int, tuple[Any, Any, Any, Callable]] = {}  # id -> (model, signature, tf.function, call)
_INFERENCE_DEVICES: dict[int, tuple[Any, str]] = {}  # a model loaded for transform -> the device it runs on


def _inference_fn(model: Any, x: Any) -> Callable | None:
    """``model(x, training=False)`` as one ``tf.function`` per model and input signature (TensorFlow backend; None
    otherwise): about 1.7x the rows/s of ``predict_on_batch``, which builds a data adapter on every call. The
    signature leaves the batch dimension open, so batches of any size share one trace (no retracing warnings)."""
    import keras

    if keras.backend.backend() != "tensorflow":
        return None
    import tensorflow as tf

    signature = tf.nest.map_structure(lambda a: tf.TensorSpec((None, *np.shape(a)[1:]), tf.as_dtype(a.dtype)), x)
    entry = _INFERENCE_FNS.get(id(model))
    if entry is None or entry[0] is not model or entry[1] != signature:
        placed = _INFERENCE_DEVICES.get(id(model))
        device = placed[1] if placed is not None and placed[0] is model else None

        def call(inputs: Any) -> Any:
            if device is None:  # a model not loaded by transform (the rank's own): TensorFlow's placement
                return model(inputs, training=False)
            with tf.device(device):
                return model(inputs, training=False)

        traced = tf.function(call, input_signature=[signature])
        entry = (model, signature, traced, lambda v: tf.nest.map_structure(lambda t: t.numpy(), traced(v)))
        _INFERENCE_FNS.clear()  # the worker's model cache keeps two models; one compiled function is enough
        _INFERENCE_FNS[id(model)] = entry
    return entry[3]


# ------------------------------------------------------------------------------------------------ optimizer


def optimizer_spec(optimizer: Any) -> dict:
    """What rebuilds ``optimizer`` on a rank: a Keras name, or its class (the user's, not a distributed wrapper)
    and ``get_config()``. Raises ``ValueError``/``TypeError`` naming what is wrong."""
    import keras

    if optimizer is None:
        raise ValueError("KerasEstimator: set optimizer, e.g. keras.optimizers.Adam(learning_rate=1e-3) or 'adam'")
    if isinstance(optimizer, str):
        try:
            keras.optimizers.get(optimizer)
        except ValueError:
            raise ValueError(f"KerasEstimator: unknown optimizer name {optimizer!r}; use a Keras optimizer name "
                             "('adam', 'sgd', 'rmsprop', 'adamw', ...) or an optimizer object") from None
        return {"name": optimizer}
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"KerasEstimator: optimizer must be a keras.optimizers.Optimizer or a Keras optimizer name, "
                        f"got {type(optimizer).__name__}")
    from spark_hvd.keras.optimizer import _DistributedOptimizerMixin

    cls = type(optimizer)
    if issubclass(cls, _DistributedOptimizerMixin):  # already wrapped: rebuild the user's class
        cls = next(c for c in cls.__mro__[1:] if not issubclass(c, _DistributedOptimizerMixin)
                   and issubclass(c, keras.optimizers.Optimizer))
    return {"cls": cls, "config": optimizer.get_config()}


def build_optimizer(spec: dict) -> Any:
    """The optimizer described by :func:`optimizer_spec` (a fresh, unbuilt one)."""
    import keras

    if "name" in spec:
        return keras.optimizers.get(spec["name"])
    return spec["cls"].from_config(spec["config"])


# ------------------------------------------------------------------------------------------------ loss, metrics


def check_losses(loss: Any, n_labels: int) -> None:
    """``loss`` fits ``n_labels`` labels: one Keras loss (name, ``Loss`` or callable) or a list with one per label."""
    import keras

    if loss is None:
        raise ValueError("KerasEstimator: set loss: a Keras loss name ('mse', 'sparse_categorical_crossentropy', "
                         "...), a keras.losses.Loss or a callable, or a list with one per label")
    if isinstance(loss, dict):
        raise TypeError("KerasEstimator: give loss as a list in label_cols order, not a dict")
    losses = list(loss) if isinstance(loss, list | tuple) else [loss]
    if isinstance(loss, list | tuple) and len(losses) != n_labels:
        raise ValueError(f"KerasEstimator: {len(losses)} losses for {n_labels} label columns; give one loss per "
                         "label (or a single loss for all of them)")
    for i, item in enumerate(losses):
        if isinstance(item, str):
            try:
                keras.losses.get(item)
            except ValueError:
                raise ValueError(f"KerasEstimator: unknown loss name {item!r} (label {i}); use a Keras loss name, "
                                 "a keras.losses.Loss or a callable") from None
        elif not callable(item):
            raise ValueError(f"KerasEstimator: loss {i} is a {type(item).__name__}, not a Keras loss or a name")


def check_metrics(metrics: list) -> None:
    """Every metric is a Keras metric name, a ``Metric`` or a callable (lists per output allowed)."""
    import keras

    for m in metrics:
        items = m if isinstance(m, list | tuple) else [m]
        for item in items:
            if isinstance(item, str):
                if item in _COMPILE_METRIC_NAMES:
                    continue
                try:
                    keras.metrics.get(item)
                except ValueError:
                    raise ValueError(f"KerasEstimator: unknown metric name {item!r}; use a Keras metric name, a "
                                     "keras.metrics.Metric or a callable") from None
            elif not callable(item):
                raise ValueError(f"KerasEstimator: metric {item!r} is not a Keras metric, a callable or a name")


def _model_output_count(model: Any) -> int | None:
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):
        return None
    return len(outputs) if outputs is not None else None


# ------------------------------------------------------------------------------------------------ the estimator


class KerasEstimator(KeywordParams, _KerasModelBytes, BaseEstimator, KerasEstimatorParams):
    """Data-parallel training of a Keras 3 model (TensorFlow or torch backend) on a DataFrame -> ``KerasModel``.

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
    _spec_class = KerasSpec
    _trainer_class = KerasTrainer

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
        data = serialize_keras_model(model, self._custom_objects())
        self._optimizer_spec = optimizer_spec(self._opt(self.optimizer))
        n_labels = len(self.getOrDefault(self.label_cols))
        n_out = _model_output_count(model)
        if n_out is not None and n_out != n_labels:
            raise ValueError(f"KerasEstimator: the model has {n_out} outputs for {n_labels} label columns "
                             f"{self.getOrDefault(self.label_cols)}; give one label column per output")
        cb = self._opt(self.checkpoint_callback)
        if cb is not None:
            import keras

            if not isinstance(cb, keras.callbacks.ModelCheckpoint):
                raise TypeError(f"KerasEstimator: checkpoint_callback must be a keras.callbacks.ModelCheckpoint, "
                                f"got {type(cb).__name__}")
        return data

    def _check_loss(self, n_labels: int) -> None:
        check_losses(self._opt(self.loss), n_labels)
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
        return BestPolicy.create(cb.monitor, cb.mode, float(cb.min_delta or 0.0))

    def _train_spec(self) -> dict:
        return {
            "optimizer": self._optimizer_spec,
            "loss": self._opt(self.loss),
            "loss_weights": self.getOrDefault(self.loss_weights),
            "metrics": tuple(self._metrics()),
            "best": self._checkpoint_policy(),
        }

    def _load_trained_model(self, store: Any, run_id: str) -> Any:
        data = RunFiles(store, run_id).read_model_file(_MODEL_FILE)
        return load_keras_bytes(data, self._custom_objects(), compile=True)

    def _model_params(self) -> dict:
        return {"custom_objects": self._custom_objects()}

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
        mlflow.keras.log_model(model, name="model", pip_requirements=reqs, **kwargs)
