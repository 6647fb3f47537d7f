"""``KerasModel.export``: the model as a Keras archive, a TensorFlow SavedModel or ONNX (through tf2onnx), verified
against the model (see ``spark_hvd.estimators.common.export`` for the directory, the manifest and the checks every
format shares)."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from spark_hvd.estimators.common import export as shared
from spark_hvd.estimators.common.export import ExportError

__all__ = ["KERAS_FORMATS", "export_keras", "run_saved_model"]

KERAS_FORMATS = ("saved_model", "keras", "onnx")


def _keras_onnx_support() -> None:
    """Keras 3 exports ONNX through tf2onnx on the TensorFlow backend; without it (or where it cannot import
    beside the installed TensorFlow and protobuf), an :class:`ExportError` that says so."""
    import keras

    if keras.backend.backend() != "tensorflow":
        return  # torch backend: Keras uses torch.onnx; JAX: jax2tf then tf2onnx (Keras's own error)
    try:
        import tf2onnx  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError, or tf2onnx failing against this protobuf / numpy
        raise ExportError("KerasModel.export(format='onnx'): Keras 3 exports ONNX through tf2onnx on the "
                          f"TensorFlow backend, and tf2onnx is not usable here ({type(exc).__name__}: "
                          f"{shared.first_line(exc, 200)}; TensorFlow {_tf_version()}): pip install "
                          "'spark_hvd[export]' (tf2onnx >= 1.17 takes a recent protobuf), or export "
                          "format='saved_model' and convert it where tf2onnx runs") from exc


def _tf_version() -> str:
    try:
        import tensorflow as tf

        return tf.__version__
    except ImportError:
        return "(not installed)"


def _keras_input_names(model: Any, specs: list[dict]) -> list[str]:
    try:
        names = [getattr(t, "name", None) for t in model.inputs]
    except Exception:  # noqa: BLE001 - a subclassed model has no symbolic inputs
        names = []
    if len(names) != len(specs) or not all(names):
        return [s["name"] for s in specs]
    return [str(n).split(":")[0] for n in names]


def _run_keras_artifact(fmt: str, file: Path, inputs: list[np.ndarray], custom_objects: dict) -> list[np.ndarray]:
    from spark_hvd.estimators.keras.inference import predict

    if fmt == "keras":
        import keras

        return predict(keras.saving.load_model(str(file), custom_objects=custom_objects, compile=False), inputs)
    if fmt == "onnx":
        return shared.run_onnx(file, inputs)
    return run_saved_model(file, inputs)


def run_saved_model(directory: str | os.PathLike, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """A Keras-exported SavedModel's ``serve`` endpoint on ``inputs`` (one array, or a list for several inputs)."""
    import tensorflow as tf

    loaded = tf.saved_model.load(str(directory))
    x = [tf.constant(a) for a in inputs]
    out = loaded.serve(x[0] if len(x) == 1 else x)
    if isinstance(out, dict):
        out = list(out.values())
    if not isinstance(out, list | tuple):
        out = [out]
    return [np.asarray(o) for o in out]


def export_keras(stage: Any, path: str | os.PathLike, format: str = "saved_model", example: Any = None,  # noqa: A002
                 verify: bool = True, opset: int | None = None, rtol: float = 1e-4,
                 atol: float = 1e-5) -> dict[str, Any]:
    """``KerasModel.export`` (see the module docstring); returns the manifest written beside the artifact."""
    import keras

    from spark_hvd.estimators.keras.inference import predict

    shared.check_format(stage, format, KERAS_FORMATS)
    model = stage.getModel()
    if model is None:
        raise ExportError(f"{type(stage).__name__}.export: the stage has no model")
    if format == "onnx":
        _keras_onnx_support()
    inputs = [np.ascontiguousarray(x) for x in shared.example_inputs(stage, example)]
    expected = predict(model, inputs)
    input_names = _keras_input_names(model, stage._feature_specs())
    directory, file = shared.target(path, format)
    who = f"{type(stage).__name__}.export(format={format!r})"
    try:
        if format == "keras":
            model.save(str(file))
        else:
            import tensorflow as tf

            signature = [tf.TensorSpec((None, *x.shape[1:]), tf.as_dtype(x.dtype), name=n)
                         for x, n in zip(inputs, input_names, strict=True)]
            kwargs: dict[str, Any] = {"input_signature": [signature[0] if len(signature) == 1 else signature]}
            if format == "onnx" and opset is not None:
                kwargs["opset_version"] = opset
            from spark_hvd.estimators.common import compat

            with _quiet():
                compat.keras_export(model, str(file), "tf_saved_model" if format == "saved_model" else "onnx",
                                    verbose=False, **kwargs)
    except ExportError:
        raise
    except Exception as exc:  # noqa: BLE001 - the exporters' errors: all mean "cannot export"
        layer = _keras_culprit(model, exc)
        raise ExportError(f"{who}: {layer} cannot be exported: {shared.first_line(exc)}") from exc
    manifest = shared.write_manifest(stage, directory, format, "keras", inputs, expected, input_names,
                               {"keras": keras.__version__, "backend": keras.backend.backend()})
    if verify:
        custom = stage._custom_objects() if hasattr(stage, "_custom_objects") else {}
        for batch in shared.verify_inputs(inputs):
            shared.compare(type(stage).__name__ + ".export", format, _run_keras_artifact(format, file, batch, custom),
                     predict(model, batch), rtol, atol)
    return manifest


def _keras_culprit(model: Any, exc: BaseException) -> str:
    """``"layer '<name>' (<Class>)"`` of the innermost layer of ``model`` on ``exc``'s traceback, else the model."""
    layers = {}
    try:
        for layer in model._flatten_layers(include_self=True, recursive=True):
            layers[id(layer)] = layer
    except Exception:  # noqa: BLE001 - a private Keras method: without it, name the model
        layers = {id(model): model}
    found = None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        candidate = frame.f_locals.get("self")
        if candidate is not None and id(candidate) in layers:
            found = candidate
    found = found or model
    kind = "model" if found is model else "layer"
    return f"{kind} {getattr(found, 'name', '?')!r} ({type(found).__name__})"


class _quiet:
    """Silence a Keras / TensorFlow exporter's prints (it writes its progress to stdout)."""

    def __enter__(self) -> None:
        self._stdout = sys.stdout
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115

    def __exit__(self, *exc: Any) -> None:
        sys.stdout.close()
        sys.stdout = self._stdout
