"""Keras's backend (``tensorflow``, ``torch``, ``jax``) per process, for the ``backend`` param of ``KerasEstimator``
and ``KerasModel``.

Keras fixes its backend when it is first imported (``KERAS_BACKEND``), and Spark reuses Python workers: a worker
that ran Keras on one backend cannot run it on another. So a rank or a ``transform`` first looks at what this
process has loaded: nothing yet, the backend is set and Keras imported on it; the same backend, it runs here;
another one, it runs in a fresh Python process (``spark_hvd.runner.fresh``): the whole rank (all ranks of the job
together, on a new ring), or, for ``transform``, a helper process that loads the model once and predicts its
batches.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from typing import Any

import numpy as np

from spark_hvd.estimators.common.errors import param_error
from spark_hvd.estimators.common.model import TASK_GPU_ENV, task_device, task_gpu_index, task_threads
from spark_hvd.estimators.keras.inference import place_for_inference, predict
from spark_hvd.estimators.keras.serde import deserialize_keras_model, model_backend

__all__ = ["BACKENDS", "loaded_backend", "resolve_backend", "runs_here", "set_threads", "load_for_inference",
           "FreshKerasModel"]

log = logging.getLogger(__name__)

#: Keras's backends that spark_hvd trains on (the package each needs has the same name)
BACKENDS = ("tensorflow", "torch", "jax")


def loaded_backend() -> str | None:
    """The backend of the Keras imported in this process, or None when Keras is not imported yet."""
    keras = sys.modules.get("keras")
    if keras is None:
        return None
    try:
        return str(keras.config.backend())
    except AttributeError:  # a partly imported keras
        return os.environ.get("KERAS_BACKEND", "tensorflow")


def resolve_backend(backend: str | None, owner: str = "KerasEstimator") -> str:
    """On the driver: ``backend`` checked (one of ``BACKENDS``, its package installed), or, for None, the driver's
    own Keras backend."""
    if backend is None:
        import keras

        backend = str(keras.config.backend())
    if backend not in BACKENDS:
        raise param_error(owner, f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if importlib.util.find_spec(backend) is None:
        extra = {"tensorflow": "tensorflow", "torch": "torch", "jax": "jax"}[backend]
        raise param_error(owner, f"backend={backend!r} needs the {backend} package, which is not installed here "
                          f"(pip install 'spark_hvd[{extra}]' on the driver and the executors)")
    return backend


def runs_here(backend: str | None) -> bool:
    """Whether Keras runs on ``backend`` in this process: True when it is loaded on it (or ``backend`` is None), or
    not loaded yet (``KERAS_BACKEND`` is then set, so the next ``import keras`` takes it); False when another
    backend is loaded."""
    if backend is None:
        return True
    loaded = loaded_backend()
    if loaded is None:
        os.environ["KERAS_BACKEND"] = backend
        return True
    return loaded == backend


def set_threads(intra_op: int, inter_op: int) -> None:
    """This process's threads under Keras's backend: TensorFlow's intra-/inter-op pools (before its runtime
    starts; a runtime already started in this reused Python worker keeps its setting), or torch's."""
    import keras

    if keras.backend.backend() == "torch":
        import torch

        torch.set_num_threads(intra_op)
        return
    if keras.backend.backend() != "tensorflow":  # JAX: XLA's CPU threads are set by its flags, not here
        return
    os.environ.setdefault("TF_NUM_INTRAOP_THREADS", str(intra_op))
    os.environ.setdefault("TF_NUM_INTEROP_THREADS", str(inter_op))
    import tensorflow as tf

    try:
        tf.config.threading.set_intra_op_parallelism_threads(intra_op)
        tf.config.threading.set_inter_op_parallelism_threads(inter_op)
    except RuntimeError:
        pass



# ------------------------------------------------------------------------------------------------ transform


def load_for_inference(data: bytes, use_gpu: bool = False) -> Any:
    """The model in ``data`` (``serialize_keras_model``'s bytes) ready for ``transform`` in this process: on its
    recorded backend here, or a ``FreshKerasModel`` when this process runs Keras on another one."""
    backend = model_backend(data)
    if not runs_here(backend):
        return FreshKerasModel(data, backend, use_gpu)
    import keras

    threads = task_threads()
    if threads is not None:
        set_threads(threads, inter_op=1)
    model = deserialize_keras_model(data, compile=False)
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        index = task_gpu_index(use_gpu, len(tf.config.list_physical_devices("GPU")))
        place_for_inference(model, "/CPU:0" if index is None else f"/GPU:{index}")
    elif use_gpu:  # JAX / torch backends place by their own defaults (the first visible GPU)
        log.info("use_gpu with Keras on the %s backend: the backend places the model (its default device), not "
                 "spark_hvd", keras.backend.backend())
    return model



class FreshKerasModel:
    """A Keras model loaded on ``backend`` in a helper process (``FreshProcess``), for a Python worker whose Keras
    runs on another backend: ``predict(inputs)`` sends a batch there and returns the outputs."""

    def __init__(self, data: bytes, backend: str, use_gpu: bool) -> None:
        from spark_hvd.runner.fresh import FreshProcess

        self.backend = backend
        env = {"KERAS_BACKEND": backend}
        address = task_device(use_gpu).address
        if address is not None:  # the helper has no TaskContext: the GPU Spark gave this task
            env[TASK_GPU_ENV] = address
        self._proc = FreshProcess(env=env)
        self._proc.call(_load_in_helper, data, use_gpu)

    def predict(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        return self._proc.call(_predict_in_helper, inputs)


_HELPER_MODEL: list[Any] = []  # in the helper process: the model it serves


def _load_in_helper(data: bytes, use_gpu: bool) -> None:
    _HELPER_MODEL[:] = [load_for_inference(data, use_gpu)]


def _predict_in_helper(inputs: list[np.ndarray]) -> list[np.ndarray]:
    return predict(_HELPER_MODEL[0], inputs)
