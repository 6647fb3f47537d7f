"""``TorchModel.export`` / ``LightningModel.export`` / ``KerasModel.export``: the artifact, loaded in a fresh Python
process (``torch.jit.load``, ``onnxruntime``, ``tf.saved_model.load``, ``keras.saving.load_model``), gives the
network's outputs on random inputs of batch sizes the export never saw; the JSON beside it names the inputs and
outputs; a network that cannot be exported gets an error naming the module and the reason. No Spark needed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pandas as pd
import pytest
import torch

from spark_hvd.estimators import LightningModel, TorchModel
from spark_hvd.estimators.common.export import MANIFEST, ExportError, read_manifest

#: Loads the artifact of an export directory in a fresh interpreter, runs it on the arrays of an .npz (in the
#: order of the JSON's inputs) and writes its outputs to another .npz.
_FRESH = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import numpy as np
    directory, src, dst = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    manifest = json.loads((directory / "spark_hvd_export.json").read_text())
    data = np.load(src)
    inputs = [data[f"x{i}"] for i in range(len(manifest["inputs"]))]
    file = directory / manifest["file"]
    fmt = manifest["format"]
    if fmt == "torchscript":
        import torch
        out = torch.jit.load(str(file))(*[torch.from_numpy(x) for x in inputs])
        outs = [out] if isinstance(out, torch.Tensor) else list(out)
        outs = [o.detach().numpy() for o in outs]
    elif fmt == "onnx":
        import onnxruntime as ort
        sess = ort.InferenceSession(str(file), providers=["CPUExecutionProvider"])
        names = [i.name for i in sess.get_inputs()]
        assert names == [i["name"] for i in manifest["inputs"]], (names, manifest["inputs"])
        outs = sess.run(None, dict(zip(names, inputs)))
    elif fmt == "saved_model":
        import tensorflow as tf
        loaded = tf.saved_model.load(str(file))
        x = [tf.constant(a) for a in inputs]
        out = loaded.serve(x[0] if len(x) == 1 else x)
        outs = [np.asarray(o) for o in (out if isinstance(out, (list, tuple)) else [out])]
    elif fmt == "keras":
        import keras
        model = keras.saving.load_model(str(file), compile=False)
        out = model(inputs[0] if len(inputs) == 1 else inputs, training=False)
        outs = [np.asarray(o) for o in (out if isinstance(out, (list, tuple)) else [out])]
    np.savez(dst, **{f"y{i}": np.asarray(o) for i, o in enumerate(outs)})
""")


def run_fresh(directory, inputs: list[np.ndarray], tmp_path) -> list[np.ndarray]:
    """The exported artifact's outputs on ``inputs``, computed by a new Python process."""
    src, dst = tmp_path / "in.npz", tmp_path / "out.npz"
    np.savez(src, **{f"x{i}": x for i, x in enumerate(inputs)})
    proc = subprocess.run([sys.executable, "-c", _FRESH, str(directory), str(src), str(dst)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = np.load(dst)
    return [out[f"y{i}"] for i in range(len(out.files))]


def _mlp(n_in: int = 4, n_out: int = 3, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(n_in, 16), torch.nn.Tanh(), torch.nn.Linear(16, n_out)).eval()


class TwoHeads(torch.nn.Module):
    """Two inputs (a vector and a scalar per row), two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 1)
        self.b = torch.nn.Linear(1, 2)

    def forward(self, v, s):
        h = self.a(v) + s.unsqueeze(1)
        return h, self.b(h)


class Gate(torch.nn.Module):
    """Data-dependent control flow that neither a trace nor torch.export can capture (and a numpy call, so
    ``torch.jit.script`` fails too)."""

    def forward(self, x):
        if float(x.sum()) > np.float32(0.0):
            return torch.relu(x)
        return -x


class Gated(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.lin(x))


def _have(*modules: str) -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in modules)


#: torch's formats; ONNX where the ``export`` extra is installed (onnx, onnxscript, onnxruntime)
TORCH_FORMATS = ["torchscript", pytest.param("onnx", marks=pytest.mark.skipif(
    not _have("onnx", "onnxscript", "onnxruntime"), reason="pip install 'spark_hvd[export]'"))]


def _random(shape, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("fmt", TORCH_FORMATS)
def test_torch_export_matches_module_in_fresh_process(fmt, tmp_path):
    net = _mlp()
    model = TorchModel(model=net, feature_cols=["features"], label_cols=["y"],
                       metadata={"features": {"features": {"dtype": "float32", "shape": [4], "kind": "array"}}})
    manifest = model.export(str(tmp_path / "out"), format=fmt)
    assert manifest == read_manifest(tmp_path / "out")
    assert manifest["inputs"] == [{"name": "features", "feature_col": "features", "dtype": "float32",
                                   "shape": [None, 4]}]
    assert manifest["outputs"] == [{"name": "y__output", "dtype": "float32", "shape": [None, 3]}]
    for rows in (1, 37):  # batch sizes the export never saw
        x = _random((rows, 4), rows)
        got = run_fresh(tmp_path / "out", [x], tmp_path)
        with torch.no_grad():
            expect = net(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(got[0], expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", TORCH_FORMATS)
def test_torch_export_two_inputs_two_outputs_example_frame(fmt, tmp_path):
    """No recorded shapes: the example is a pandas frame of raw rows, run through transform's preprocessing."""
    torch.manual_seed(1)
    net = TwoHeads().eval()
    model = TorchModel(model=net, feature_cols=["v", "s"], label_cols=["h", "k"])
    example = pd.DataFrame({"v": [_random(3, i).tolist() for i in range(4)], "s": _random(4, 9).tolist()})
    manifest = model.export(str(tmp_path / "out"), format=fmt, example=example)
    assert [(i["name"], i["shape"]) for i in manifest["inputs"]] == [("v", [None, 3]), ("s", [None])]
    assert [(o["name"], o["shape"]) for o in manifest["outputs"]] == [("h__output", [None, 1]),
                                                                        ("k__output", [None, 2])]
    v, s = _random((11, 3), 5), _random(11, 6)
    got = run_fresh(tmp_path / "out", [v, s], tmp_path)
    with torch.no_grad():
        expect = [t.numpy() for t in net(torch.from_numpy(v), torch.from_numpy(s))]
    for g, e in zip(got, expect, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", TORCH_FORMATS)
def test_data_dependent_control_flow_names_the_module(fmt, tmp_path):
    model = TorchModel(model=Gated().eval(), feature_cols=["x"], label_cols=["y"])
    with pytest.raises(ExportError) as err:
        model.export(str(tmp_path / "out"), format=fmt, example=[_random((2, 4), 0)])
    message = str(err.value)
    assert "'gate' (Gate)" in message, message
    assert "data-dependent" in message, message
    assert not (tmp_path / "out" / MANIFEST).exists()


def test_unknown_format_and_missing_shapes(tmp_path):
    model = TorchModel(model=_mlp(), feature_cols=["x"], label_cols=["y"])
    with pytest.raises(ExportError, match="unknown format 'saved_model'"):
        model.export(str(tmp_path / "a"), format="saved_model", example=[_random((2, 4), 0)])
    with pytest.raises(ExportError, match=r"per-row shape of feature column\(s\) \['x'\].*example="):
        model.export(str(tmp_path / "b"))


def test_lightning_model_exports_as_torch(tmp_path):
    from helpers.lightning_modules import Reg

    torch.manual_seed(3)
    net = Reg().eval()
    model = LightningModel(model=net, feature_cols=["features"], label_cols=["y"])
    manifest = model.export(str(tmp_path / "ts"), format="torchscript", example=[_random((2, 3), 0)])
    assert manifest["stage"] == "LightningModel" and manifest["inputs"][0]["shape"] == [None, 3]
    subs = ["ts"]
    if _have("onnx", "onnxscript", "onnxruntime"):
        model.export(str(tmp_path / "onnx"), format="onnx", example=[_random((2, 3), 0)])
        subs.append("onnx")
    x = _random((9, 3), 7)
    with torch.no_grad():
        expect = net(torch.from_numpy(x)).numpy()
    for sub in subs:
        np.testing.assert_allclose(run_fresh(tmp_path / sub, [x], tmp_path)[0], expect, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ keras


def _keras_net():
    import keras

    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,), name="features")
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2)(h))


@pytest.mark.slow  # TensorFlow in the test process and in the fresh one
@pytest.mark.parametrize("fmt", ["saved_model", "keras"])
def test_keras_export_matches_model_in_fresh_process(fmt, tmp_path):
    from spark_hvd.estimators import KerasModel

    net = _keras_net()
    model = KerasModel(model=net, feature_cols=["features"], label_cols=["y"])
    manifest = model.export(str(tmp_path / "out"), format=fmt, example=[_random((2, 4), 0)])
    assert manifest["inputs"] == [{"name": "features", "feature_col": "features", "dtype": "float32",
                                   "shape": [None, 4]}]
    assert manifest["outputs"][0]["shape"] == [None, 2]
    x = _random((13, 4), 3)
    got = run_fresh(tmp_path / "out", [x], tmp_path)
    np.testing.assert_allclose(got[0], np.asarray(net(x, training=False)), rtol=1e-5, atol=1e-5)
    assert json.loads((tmp_path / "out" / MANIFEST).read_text())["format"] == fmt


@pytest.mark.slow
def test_keras_onnx_exports_or_says_why(tmp_path):
    """Keras 3 exports ONNX through tf2onnx on TensorFlow: where it is not usable, the error says so."""
    from spark_hvd.estimators import KerasModel

    net = _keras_net()
    model = KerasModel(model=net, feature_cols=["features"], label_cols=["y"])
    try:
        import onnxruntime  # noqa: F401
        import tf2onnx  # noqa: F401
    except Exception:  # noqa: BLE001
        with pytest.raises(ExportError, match="tf2onnx|onnxruntime"):
            model.export(str(tmp_path / "out"), format="onnx", example=[_random((2, 4), 0)])
        return
    model.export(str(tmp_path / "out"), format="onnx", example=[_random((2, 4), 0)])
    x = _random((13, 4), 3)
    np.testing.assert_allclose(run_fresh(tmp_path / "out", [x], tmp_path)[0], np.asarray(net(x, training=False)),
                               rtol=1e-5, atol=1e-5)
