"""A fitted stage's network out of Spark: TorchScript or ONNX for a ``TorchModel`` / ``LightningModel``, a Keras
archive, a TensorFlow SavedModel or ONNX for a ``KerasModel`` (``<Model>.export(path, format=...)``).

``export`` writes into the directory ``path``: the artifact (``model.pt``, ``model.onnx``, ``model.keras`` or
``saved_model/``) and ``spark_hvd_export.json`` beside it, which names the inputs (the feature columns, in the
order the network takes them), their dtypes and per-row shapes, the outputs (the output columns) and their
shapes; the first dimension of every input and output is the batch, left open (``null`` in the JSON).

The artifact holds the network only: it takes the model's inputs as ``transform`` hands them to the network,
after the preprocessing (``transformation_fn``, ``collate_fn``, Vectors made arrays, ragged columns padded). A
stage with a ``transformation_fn`` or ``collate_fn`` records that in the JSON (``"preprocessing"``); the MLflow
pyfunc (``log_mlflow``) is the way out that carries it.

The example inputs come from the fit's metadata (feature shapes and dtypes), or from ``example``: a DataFrame
(Spark or pandas) of raw rows, run through ``transform``'s own preprocessing (``model.model_inputs``), or a list
of arrays, one per feature column. With ``verify`` (the default) the written artifact is loaded back, run on the
example and on random inputs of another batch size, and compared with the stage's network: a mismatch raises.

A network that cannot be exported raises :class:`ExportError` naming the module (its path in the network and
its class) and the reason: data-dependent control flow that a trace would freeze, an operator the exporter does
not support, a batch dimension the network fixes.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from spark_hvd.estimators.errors import EstimatorError

__all__ = ["ExportError", "MANIFEST", "TORCH_FORMATS", "KERAS_FORMATS", "export_torch", "export_keras",
           "read_manifest"]

log = logging.getLogger(__name__)

#: The JSON written beside the artifact.
MANIFEST = "spark_hvd_export.json"
TORCH_FORMATS = ("torchscript", "onnx")
KERAS_FORMATS = ("saved_model", "keras", "onnx")
_FILES = {"torchscript": "model.pt", "onnx": "model.onnx", "keras": "model.keras", "saved_model": "saved_model"}
#: Rows of the random batch ``verify`` runs besides the example (another size than the example's).
_VERIFY_ROWS = (3, 5)


class ExportError(EstimatorError, ValueError):
    """A fitted stage's network cannot be exported in the asked format (the message says which module and why)."""


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The ``spark_hvd_export.json`` of an export directory (``path``: the directory or the JSON)."""
    p = Path(path)
    return json.loads((p / MANIFEST if p.is_dir() else p).read_text())


# ------------------------------------------------------------------------------------------------ example inputs


def example_inputs(stage: Any, example: Any = None, rows: int = 2) -> list[np.ndarray]:
    """The network's inputs for a few rows: from ``example`` (a Spark or pandas DataFrame of raw rows, through
    ``transform``'s preprocessing; or a list of arrays), else random values of the fit's recorded shapes."""
    specs = stage._feature_specs()
    if example is None:
        unknown = [s["name"] for s in specs if s.get("shape") is None or s.get("kind", "scalar") not in
                   ("scalar", "vector", "array")]
        if unknown:
            raise ExportError(f"{type(stage).__name__}.export: the per-row shape of feature column(s) {unknown} is "
                              "not recorded (a model not made by fit, or a column the preprocessing turns into "
                              "the network's input): pass example=<a DataFrame of a few raw rows> or a list of "
                              "arrays, one per feature column")
        return _random_like([np.zeros((rows, *s["shape"]), s.get("dtype") or "float32") for s in specs], rows, 0)
    if isinstance(example, list | tuple):
        if len(example) != len(specs):
            raise ExportError(f"{type(stage).__name__}.export: example has {len(example)} arrays for "
                              f"{len(specs)} feature columns {[s['name'] for s in specs]}")
        return [np.asarray(x) for x in example]
    from spark_hvd.estimators.model import model_inputs

    table = _example_table(stage, example, rows)
    names = table.schema.names
    feature_idx = [names.index(s["name"]) for s in specs]
    return model_inputs(table, feature_idx, specs, stage._opt(stage.transformation_fn),
                        stage._opt(stage.collate_fn), stage._ragged())


def _example_table(stage: Any, example: Any, rows: int) -> Any:
    """The first ``rows`` rows of a Spark or pandas DataFrame as a pyarrow Table, Vectors as arrays."""
    import pyarrow as pa

    if hasattr(example, "sparkSession"):
        from spark_hvd.estimators import compat

        prepared, feature_idx, _ = stage._prepared_input(example.limit(rows))
        table = compat.to_arrow(prepared)
        names = [s["name"] for s in stage._feature_specs()]
        return pa.table({n: table.column(i) for n, i in zip(names, feature_idx, strict=True)})
    from spark_hvd.estimators.pyfunc import frame_to_table

    return frame_to_table(stage, example.head(rows))


def _random_like(arrays: list[np.ndarray], rows: int, seed: int) -> list[np.ndarray]:
    """Random arrays of the dtypes and per-row shapes of ``arrays`` with ``rows`` rows: floats standard normal,
    integers in ``[0, max + 1)`` of the example (token or class ids stay in the network's range), bools random."""
    rng = np.random.default_rng(seed)
    out = []
    for a in arrays:
        shape = (rows, *a.shape[1:])
        if np.issubdtype(a.dtype, np.floating):
            out.append(rng.standard_normal(shape).astype(a.dtype))
        elif np.issubdtype(a.dtype, np.integer):
            high = int(a.max()) + 1 if a.size else 2
            out.append(rng.integers(0, max(high, 1), shape).astype(a.dtype))
        elif a.dtype == np.bool_:
            out.append(rng.integers(0, 2, shape).astype(bool))
        else:
            raise ExportError(f"an input of dtype {a.dtype} cannot be exported: the network must take numeric "
                              "arrays (decode strings or bytes in the preprocessing)")
    return out


def _verify_inputs(example: list[np.ndarray]) -> list[list[np.ndarray]]:
    """The example and random inputs of another batch size (a network that fixed the batch dimension fails)."""
    n = len(example[0])
    other = _VERIFY_ROWS[0] if n != _VERIFY_ROWS[0] else _VERIFY_ROWS[1]
    return [example, _random_like(example, other, 1)]


def _compare(who: str, fmt: str, got: list[np.ndarray], expected: list[np.ndarray], rtol: float,
             atol: float) -> None:
    if len(got) != len(expected):
        raise ExportError(f"{who}: the {fmt} artifact returned {len(got)} outputs, the network {len(expected)}")
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        g = np.asarray(g)
        if g.shape != e.shape or not np.allclose(g, e, rtol=rtol, atol=atol):
            diff = float(np.max(np.abs(g.astype(np.float64) - e))) if g.shape == e.shape else None
            raise ExportError(f"{who}: the {fmt} artifact's output {i} differs from the network's "
                              f"(shape {g.shape} vs {e.shape}, max abs difference {diff}): the network does "
                              "something the exporter does not capture (data-dependent control flow, a fixed "
                              "batch size); export it in another format or change the module")


def _write_manifest(stage: Any, directory: Path, fmt: str, framework: str, example: list[np.ndarray],
                    outputs: list[np.ndarray], input_names: list[str], extra: dict | None = None) -> dict:
    specs = stage._feature_specs()
    out_cols = stage.getOutputCols()
    if len(out_cols) != len(outputs):
        out_cols = [f"output_{i}" for i in range(len(outputs))]
    manifest = {
        "format": fmt,
        "framework": framework,
        "file": _FILES[fmt],
        "stage": type(stage).__name__,
        "inputs": [{"name": name, "feature_col": s["name"], "dtype": str(x.dtype), "shape": [None, *x.shape[1:]]}
                   for name, s, x in zip(input_names, specs, example, strict=True)],
        "outputs": [{"name": c, "dtype": str(o.dtype), "shape": [None, *o.shape[1:]]}
                    for c, o in zip(out_cols, outputs, strict=True)],
        "preprocessing": {"transformation_fn": stage._opt(stage.transformation_fn) is not None,
                          "collate_fn": stage._opt(stage.collate_fn) is not None},
        **(extra or {}),
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _check_format(stage: Any, fmt: str, formats: tuple[str, ...]) -> None:
    if fmt not in formats:
        raise ExportError(f"{type(stage).__name__}.export: unknown format {fmt!r}; one of {list(formats)}")


def _target(path: str | os.PathLike, fmt: str) -> tuple[Path, Path]:
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    artifact = directory / _FILES[fmt]
    if artifact.exists():
        raise ExportError(f"export: {artifact} already exists; export into an empty directory")
    return directory, artifact


# ------------------------------------------------------------------------------------------------ torch


def _culprit(module: Any, exc: BaseException) -> str:
    """``"'<path>' (<Class>)"`` of the innermost submodule of ``module`` whose ``forward`` is on ``exc``'s
    traceback (the module the export failed in), else the network's own class."""
    names = {id(m): n for n, m in module.named_modules()}
    found = None
    tb = exc.__traceback__
    seen: set[int] = set()
    chain: BaseException | None = exc
    while chain is not None and id(chain) not in seen:  # the error and the errors it was raised from
        seen.add(id(chain))
        tb = chain.__traceback__
        while tb is not None:
            candidate = tb.tb_frame.f_locals.get("self")
            if candidate is not None and id(candidate) in names:
                found = candidate
            tb = tb.tb_next
        chain = chain.__cause__ or chain.__context__
    if found is None:
        return f"{type(module).__name__} (the network)"
    path = names[id(found)] or "<the network>"
    return f"{path!r} ({type(found).__name__})"


def _in_chain(exc: BaseException, kind: type) -> BaseException | None:
    """The first error of type ``kind`` among ``exc`` and the errors it was raised from or during."""
    seen: set[int] = set()
    chain: BaseException | None = exc
    while chain is not None and id(chain) not in seen:
        if isinstance(chain, kind):
            return chain
        seen.add(id(chain))
        chain = chain.__cause__ or chain.__context__
    return None


def _first_line(exc: BaseException, limit: int = 600) -> str:
    """The reason of an exporter's error: its message without the exporter's long advice, one paragraph."""
    text = str(exc).strip() or type(exc).__name__
    paragraph = text.split("\n\n")[0].strip()
    return (paragraph[:limit] + " ...") if len(paragraph) > limit else paragraph


def _torch_outputs(out: Any) -> list[np.ndarray]:
    import torch

    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    return [o.detach().cpu().numpy() for o in outs]


def _torchscript(stage: Any, module: Any, tensors: tuple) -> Any:
    """``torch.jit.script`` (keeps control flow), else ``torch.jit.trace`` with a data-dependent branch (a
    ``TracerWarning``) as an :class:`ExportError` naming the module."""
    import torch

    with _jit_mode(module):
        try:
            return torch.jit.script(module)
        except Exception as exc:  # noqa: BLE001 - any scripting failure: a trace may still do
            log.info("export: torch.jit.script failed (%s); tracing instead", _first_line(exc, 200))
    who = type(stage).__name__
    try:
        with warnings.catch_warnings(), _jit_mode(module):
            warnings.simplefilter("error", torch.jit.TracerWarning)
            with torch.no_grad():
                return torch.jit.trace(module, tensors, check_trace=False)
    except Exception as exc:  # noqa: BLE001
        warning = _in_chain(exc, torch.jit.TracerWarning)  # raised inside a C call: its SystemError's context
        if warning is not None:
            raise ExportError(f"{who}.export(format='torchscript'): module {_culprit(module, exc)} cannot be "
                              "traced: data-dependent control flow or a value read out of a tensor "
                              f"({_first_line(warning)}); a trace would freeze the branch the example took") from exc
        raise ExportError(f"{who}.export(format='torchscript'): module {_culprit(module, exc)} can be neither "
                          f"scripted nor traced: {_first_line(exc)}") from exc


class _jit_mode:  # noqa: N801 - a context manager used as a function
    """A LightningModule's ``_jit_is_scripting`` set while it is scripted or traced (as its own
    ``to_torchscript`` does: its ``trainer`` property and logging then stay quiet); a plain module: nothing."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.had = getattr(module, "_jit_is_scripting", None)

    def __enter__(self) -> None:
        if self.had is not None:
            self.module._jit_is_scripting = True

    def __exit__(self, *exc: Any) -> None:
        if self.had is not None:
            self.module._jit_is_scripting = self.had


def _onnx(stage: Any, module: Any, tensors: tuple, input_names: list[str], output_names: list[str],
          file: Path, opset: int | None) -> None:
    """``torch.onnx.export`` (the ``torch.export``-based exporter) with the batch dimension of every input open."""
    import torch

    who = type(stage).__name__
    try:
        import onnxscript  # noqa: F401 - the exporter needs it; say so before torch's own error does
    except ImportError as exc:
        raise ExportError(f"{who}.export(format='onnx') needs the packages onnx, onnxscript and onnxruntime: "
                          "pip install 'spark_hvd[export]'") from exc
    batch = torch.export.Dim("batch", min=1)
    dynamic = tuple({0: batch} for _ in tensors)
    kwargs: dict[str, Any] = {"input_names": input_names, "output_names": output_names,
                              "dynamic_shapes": dynamic, "dynamo": True, "verbose": False}
    if opset is not None:
        kwargs["opset_version"] = opset
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(module, tensors, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the exporter's errors are many types; all mean "cannot export"
        reason = _first_line(exc)
        hint = ""
        if any(k in str(exc) for k in ("data-dependent", "GuardOnDataDependent", "Could not guard on")):
            hint = "data-dependent control flow (a branch on a tensor's value): "
        elif any(k in str(exc) for k in ("Constraints violated", "specialized", "batch")):
            hint = "the network fixes the batch dimension: "
        raise ExportError(f"{who}.export(format='onnx'): module {_culprit(module, exc)} cannot be exported to "
                          f"ONNX: {hint}{reason}") from exc
    program.save(str(file))


def _run_torch_artifact(fmt: str, file: Path, inputs: list[np.ndarray]) -> list[np.ndarray]:
    if fmt == "torchscript":
        import torch

        loaded = torch.jit.load(str(file), map_location="cpu")
        with torch.no_grad():
            return _torch_outputs(loaded(*[torch.from_numpy(np.ascontiguousarray(x)) for x in inputs]))
    return run_onnx(file, inputs)


def run_onnx(file: str | os.PathLike, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """An ONNX file run by onnxruntime on the CPU, its inputs in order."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise ExportError("checking an ONNX export needs onnxruntime: pip install 'spark_hvd[export]' (or "
                          "export with verify=False)") from exc
    session = ort.InferenceSession(str(file), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    if len(names) != len(inputs):
        raise ExportError(f"the ONNX graph takes {len(names)} inputs {names}, given {len(inputs)}")
    return [np.asarray(o) for o in session.run(None, dict(zip(names, inputs, strict=True)))]


def export_torch(stage: Any, path: str | os.PathLike, format: str = "torchscript", example: Any = None,  # noqa: A002
                 verify: bool = True, opset: int | None = None, rtol: float = 1e-4,
                 atol: float = 1e-5) -> dict[str, Any]:
    """``TorchModel.export`` (see the module docstring); returns the manifest written beside the artifact."""
    import copy

    import torch

    _check_format(stage, format, TORCH_FORMATS)
    if stage.getModel() is None:
        raise ExportError(f"{type(stage).__name__}.export: the stage has no model")
    inputs = [np.ascontiguousarray(x) for x in example_inputs(stage, example)]
    module = copy.deepcopy(stage.getModel()).cpu().eval()
    tensors = tuple(torch.from_numpy(x) for x in inputs)
    with torch.no_grad():
        expected = _torch_outputs(module(*tensors))
    input_names = [s["name"] for s in stage._feature_specs()]
    output_names = stage.getOutputCols() if len(stage.getOutputCols()) == len(expected) else \
        [f"output_{i}" for i in range(len(expected))]
    directory, file = _target(path, format)
    if format == "torchscript":
        _torchscript(stage, module, tensors).save(str(file))
    else:
        _onnx(stage, module, tensors, input_names, output_names, file, opset)
    manifest = _write_manifest(stage, directory, format, "torch", inputs, expected, input_names,
                               {"torch": torch.__version__})
    if verify:
        for batch in _verify_inputs(inputs):
            with torch.no_grad():
                want = _torch_outputs(module(*(torch.from_numpy(x) for x in batch)))
            _compare(type(stage).__name__ + ".export", format, _run_torch_artifact(format, file, batch), want,
                     rtol, atol)
    return manifest


# ------------------------------------------------------------------------------------------------ keras


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
                          f"{_first_line(exc, 200)}; TensorFlow {_tf_version()}): pip install "
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
    from spark_hvd.estimators.keras_inference import predict

    if fmt == "keras":
        import keras

        return predict(keras.saving.load_model(str(file), custom_objects=custom_objects, compile=False), inputs)
    if fmt == "onnx":
        return run_onnx(file, inputs)
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

    from spark_hvd.estimators.keras_inference import predict

    _check_format(stage, format, KERAS_FORMATS)
    model = stage.getModel()
    if model is None:
        raise ExportError(f"{type(stage).__name__}.export: the stage has no model")
    if format == "onnx":
        _keras_onnx_support()
    inputs = [np.ascontiguousarray(x) for x in example_inputs(stage, example)]
    expected = predict(model, inputs)
    input_names = _keras_input_names(model, stage._feature_specs())
    directory, file = _target(path, format)
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
            from spark_hvd.estimators import compat

            with _quiet():
                compat.keras_export(model, str(file), "tf_saved_model" if format == "saved_model" else "onnx",
                                    verbose=False, **kwargs)
    except ExportError:
        raise
    except Exception as exc:  # noqa: BLE001 - the exporters' errors: all mean "cannot export"
        layer = _keras_culprit(model, exc)
        raise ExportError(f"{who}: {layer} cannot be exported: {_first_line(exc)}") from exc
    manifest = _write_manifest(stage, directory, format, "keras", inputs, expected, input_names,
                               {"keras": keras.__version__, "backend": keras.backend.backend()})
    if verify:
        custom = stage._custom_objects() if hasattr(stage, "_custom_objects") else {}
        for batch in _verify_inputs(inputs):
            _compare(type(stage).__name__ + ".export", format, _run_keras_artifact(format, file, batch, custom),
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
