"""Keras 3 objects <-> bytes for the estimators: the model (its ``.keras`` file plus the ``custom_objects`` needed to
load it, cloudpickled so classes defined in a notebook travel by value) and the optimizer (its class and
``get_config()``, or a Keras name). The driver side (``keras/estimator.py``) and the rank side (``keras/rank.py``)
both use it.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

import cloudpickle

from spark_hvd import pickling
from spark_hvd.estimators.common.errors import param_error, param_type_error

__all__ = ["MODEL_FILE", "serialize_keras_model", "deserialize_keras_model", "load_keras_bytes", "model_backend",
           "optimizer_spec", "build_optimizer", "known_name"]

log = logging.getLogger(__name__)

#: the file name of a Keras model in a checkpoint and in a run's final model
MODEL_FILE = "model.keras"


# ------------------------------------------------------------------------------------------------ model bytes


def serialize_keras_model(model: Any, custom_objects: dict | None = None, backend: str | None = None) -> bytes:
    """A built Keras 3 model -> bytes: its ``.keras`` file plus ``custom_objects`` (cloudpickle envelope), and the
    Keras backend it is to run on where given (``model_backend``)."""
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
        path = os.path.join(tmp, MODEL_FILE)
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
    return cloudpickle.dumps({"format": "keras", "keras": data, "custom_objects": objects, "backend": backend})


def _unpack(data: bytes) -> tuple[bytes, dict]:
    env = cloudpickle.loads(data)
    if not isinstance(env, dict) or env.get("format") != "keras":
        raise ValueError("these bytes are not a model serialised by spark_hvd.estimators.keras")
    return env["keras"], cloudpickle.loads(env["custom_objects"])


def model_backend(data: bytes) -> str | None:
    """The Keras backend recorded with the model bytes of :func:`serialize_keras_model` (None: not recorded)."""
    env = cloudpickle.loads(data)
    return env.get("backend") if isinstance(env, dict) else None


def load_keras_bytes(keras_bytes: bytes, custom_objects: dict, compile: bool = False) -> Any:  # noqa: A002
    """The model in the bytes of a ``.keras`` file (``compile=True``: with its optimizer, loss and metrics if they
    can be rebuilt, e.g. no unregistered custom loss; falls back to an uncompiled model, with a warning)."""
    import keras

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, MODEL_FILE)
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


# ------------------------------------------------------------------------------------------------ optimizer


def known_name(get: Any, name: str) -> bool:
    """Whether Keras's lookup ``get`` (``keras.optimizers.get``, ``keras.losses.get`` ...) knows ``name``."""
    try:
        get(name)
    except ValueError:
        return False
    return True


def optimizer_spec(optimizer: Any) -> dict:
    """What rebuilds ``optimizer`` on a rank: a Keras name, or its class (the user's, not a distributed wrapper)
    and ``get_config()``. Raises ``ValueError``/``TypeError`` naming what is wrong."""
    import keras

    if optimizer is None:
        raise param_error("KerasEstimator", "set optimizer, e.g. keras.optimizers.Adam(learning_rate=1e-3) or 'adam'")
    if isinstance(optimizer, str):
        if not known_name(keras.optimizers.get, optimizer):
            raise param_error("KerasEstimator", f"unknown optimizer name {optimizer!r}; use a Keras optimizer name "
                              "('adam', 'sgd', 'rmsprop', 'adamw', ...) or an optimizer object")
        return {"name": optimizer}
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise param_type_error("KerasEstimator",
                               f"optimizer must be a keras.optimizers.Optimizer or a Keras optimizer name, "
                               f"got {type(optimizer).__name__}")
    from spark_hvd._keras_common.optimizer import _DistributedOptimizerMixin

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
