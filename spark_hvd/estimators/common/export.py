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
from pathlib import Path
from typing import Any

import numpy as np

from spark_hvd.estimators.common.errors import EstimatorError

__all__ = ["ExportError", "MANIFEST", "check_format", "compare", "example_inputs", "first_line", "read_manifest",
           "run_onnx", "target", "verify_inputs", "write_manifest"]

log = logging.getLogger(__name__)

#: The JSON written beside the artifact.
MANIFEST = "spark_hvd_export.json"
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
    from spark_hvd.estimators.common.model import model_inputs

    table = _example_table(stage, example, rows)
    names = table.schema.names
    feature_idx = [names.index(s["name"]) for s in specs]
    return model_inputs(table, feature_idx, specs, stage._opt(stage.transformation_fn),
                        stage._opt(stage.collate_fn), stage._ragged())


def _example_table(stage: Any, example: Any, rows: int) -> Any:
    """The first ``rows`` rows of a Spark or pandas DataFrame as a pyarrow Table, Vectors as arrays."""
    import pyarrow as pa

    if hasattr(example, "sparkSession"):
        from spark_hvd.estimators.common import compat

        prepared, feature_idx, _ = stage._prepared_input(example.limit(rows))
        table = compat.to_arrow(prepared)
        names = [s["name"] for s in stage._feature_specs()]
        return pa.table({n: table.column(i) for n, i in zip(names, feature_idx, strict=True)})
    from spark_hvd.estimators.common.pyfunc import frame_to_table

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


def verify_inputs(example: list[np.ndarray]) -> list[list[np.ndarray]]:
    """The example and random inputs of another batch size (a network that fixed the batch dimension fails)."""
    n = len(example[0])
    other = _VERIFY_ROWS[0] if n != _VERIFY_ROWS[0] else _VERIFY_ROWS[1]
    return [example, _random_like(example, other, 1)]


def compare(who: str, fmt: str, got: list[np.ndarray], expected: list[np.ndarray], rtol: float,
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


def write_manifest(stage: Any, directory: Path, fmt: str, framework: str, example: list[np.ndarray],
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


def check_format(stage: Any, fmt: str, formats: tuple[str, ...]) -> None:
    if fmt not in formats:
        raise ExportError(f"{type(stage).__name__}.export: unknown format {fmt!r}; one of {list(formats)}")


def target(path: str | os.PathLike, fmt: str) -> tuple[Path, Path]:
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    artifact = directory / _FILES[fmt]
    if artifact.exists():
        raise ExportError(f"export: {artifact} already exists; export into an empty directory")
    return directory, artifact


# ------------------------------------------------------------------------------------------------ torch


def first_line(exc: BaseException, limit: int = 600) -> str:
    """The reason of an exporter's error: its message without the exporter's long advice, one paragraph."""
    text = str(exc).strip() or type(exc).__name__
    paragraph = text.split("\n\n")[0].strip()
    return (paragraph[:limit] + " ...") if len(paragraph) > limit else paragraph


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




