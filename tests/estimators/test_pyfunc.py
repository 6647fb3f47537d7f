"""``<Model>.log_mlflow``: the logged pyfunc, loaded back by ``mlflow.pyfunc.load_model``, scores raw rows as
``transform`` does (``predict(pdf)`` equals ``transform(df)`` on the same rows: outputs, prediction, probability),
and so does ``mlflow.pyfunc.spark_udf`` over a DataFrame; a ``transformation_fn`` that decodes text travels inside
the model. The framework flavour is logged beside it."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from spark_hvd.estimators import TorchModel

pytestmark = pytest.mark.spark


def _mlp(n_in: int = 4, n_out: int = 3, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(n_in, 16), torch.nn.Tanh(), torch.nn.Linear(16, n_out)).eval()


def _vector_df(spark, n: int = 40, n_in: int = 4, seed: int = 1):
    from pyspark.ml.linalg import Vectors

    x = np.random.default_rng(seed).standard_normal((n, n_in))
    rows = [(i, Vectors.dense(x[i].tolist())) for i in range(n)]
    return spark.createDataFrame(rows, ["id", "features"]).repartition(2)


def _spark_udf_or_skip():
    """``mlflow.pyfunc.spark_udf``; skipped where it cannot import (mlflow-skinny 2.x: its scoring server needs
    flask, which only the full ``mlflow`` package brings)."""
    try:
        import mlflow.pyfunc.scoring_server  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"mlflow.pyfunc.spark_udf needs the full mlflow package here ({exc})")
    import mlflow.pyfunc

    return mlflow.pyfunc.spark_udf


def _sorted(df):
    return df.orderBy("id").toPandas()


@pytest.fixture(scope="module")
def classifier_model():
    """A 3-class torch classifier stage (``logits``: transform adds prediction and probability)."""
    return TorchModel(model=_mlp(), feature_cols=["features"], label_cols=["label"], batch_size=7,
                      metadata={"classifier": "logits"})


def _assert_frames_equal(got: pd.DataFrame, expect: pd.DataFrame, columns: list[str]) -> None:
    for c in columns:
        g = np.stack([np.asarray(v, dtype=np.float64).reshape(-1) for v in got[c]])
        e = np.stack([np.asarray(v.toArray() if hasattr(v, "toArray") else v, dtype=np.float64).reshape(-1)
                      for v in expect[c]])
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6, err_msg=c)


def test_torch_pyfunc_predict_equals_transform(spark, mlflow_tracking, classifier_model):
    import mlflow

    df = _vector_df(spark)
    info = classifier_model.log_mlflow(input_example=df, registered_model_name="spark-hvd-classifier")
    expect = _sorted(classifier_model.transform(df))
    assert list(expect.columns[-3:]) == ["label__output", "prediction", "probability"]

    loaded = mlflow.pyfunc.load_model("models:/spark-hvd-classifier/1")  # registered, loaded by name
    # the raw rows: a Vector column arrives as arrays of doubles (vector_to_array, a JSON request, spark_udf)
    arrays = pd.DataFrame({"features": [v.toArray().tolist() for v in expect["features"]]})
    got = loaded.predict(arrays)
    assert list(got.columns) == ["label__output", "prediction", "probability"]
    _assert_frames_equal(got, expect, ["label__output", "prediction", "probability"])
    # the unwrapped python model takes the Vectors themselves too (no signature check there)
    raw = loaded.unwrap_python_model().predict(None, expect[["features"]])
    _assert_frames_equal(raw, expect, ["label__output", "prediction", "probability"])

    # the signature names the raw input column and the transform's output columns; the network is beside it
    signature = loaded.metadata.get_input_schema().input_names(), loaded.metadata.get_output_schema().input_names()
    assert signature == (["features"], ["label__output", "prediction", "probability"])
    # a float array column is a tensor (MLflow checks it with one np.vstack, not per row), and still checked
    assert repr(loaded.metadata.get_input_schema()) == "['features': Tensor('float64', (-1, 4))]"
    with pytest.raises(mlflow.exceptions.MlflowException, match="shape"):
        loaded.predict(pd.DataFrame({"features": [[0.5, 0.5, 0.5]] * 4}))  # 3 values a row for 4
    try:  # MLflow's scoring server's handler in process (parse, cast, check, predict, JSON): no HTTP
        from mlflow.pyfunc import scoring_server
    except ImportError:  # mlflow-skinny 2.x: no flask (test_serving.py has the whole server)
        scoring_server = None
    if scoring_server is not None:
        body = json.dumps({"dataframe_split": {"columns": ["features"], "data": [[r] for r in arrays["features"]]}})
        answer = scoring_server.invocations(body, "application/json", loaded, loaded.metadata.get_input_schema())
        assert answer.status == 200, answer.response
        _assert_frames_equal(pd.DataFrame(json.loads(answer.response)["predictions"]), expect,
                             ["label__output", "prediction", "probability"])
    network = mlflow.pytorch.load_model(info.model_uri.rsplit("/", 1)[0] + "/model_network"
                                        if info.model_uri.startswith("runs:/") else
                                        f"runs:/{info.run_id}/model_network")
    x = torch.from_numpy(np.stack(arrays["features"].to_list()).astype(np.float32))
    np.testing.assert_allclose(network(x).detach().numpy(), np.stack(got["label__output"]), rtol=1e-5, atol=1e-6)

    # the registered model back as the Spark ML stage: same class, uid and params, transform equal
    back = TorchModel.load_mlflow("models:/spark-hvd-classifier/1")
    assert type(back) is TorchModel and back.uid == classifier_model.uid
    assert back.getFeatureCols() == ["features"] and back.getOrDefault("metadata") == {"classifier": "logits"}
    _assert_frames_equal(_sorted(back.transform(df)), expect, ["label__output", "prediction", "probability"])
    from spark_hvd.estimators import KerasModel

    with pytest.raises(TypeError, match="TorchModel, not a KerasModel"):
        KerasModel.load_mlflow(info.model_uri)


def test_torch_spark_udf_equals_transform(spark, mlflow_tracking, classifier_model):
    """With the full signature, and logged with ``check_input=False`` (the signature's outputs only: MLflow
    checks no input schema, which is most of ``spark_udf``'s time); both in one Spark job."""
    spark_udf = _spark_udf_or_skip()
    import mlflow.models
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F  # noqa: N812

    df = _vector_df(spark, n=30, seed=2)
    info = classifier_model.log_mlflow(input_example=df, log_network=False)  # the flavour: the test above
    unchecked = classifier_model.log_mlflow(name="unchecked", input_example=df, check_input=False,
                                            log_network=False)
    signature = mlflow.models.get_model_info(unchecked.model_uri).signature
    assert signature.inputs is None
    assert signature.outputs.input_names() == ["label__output", "prediction", "probability"]
    expect = _sorted(classifier_model.transform(df))
    result_type = "label__output array<float>, prediction double, probability array<double>"
    udf, udf_unchecked = (spark_udf(spark, i.model_uri, env_manager="local", result_type=result_type)
                          for i in (info, unchecked))
    arrays = df.withColumn("features", vector_to_array("features"))
    both = _sorted(arrays.select("id", udf(F.struct("features")).alias("a"),
                                 udf_unchecked(F.struct("features")).alias("b")).select("id", "a.*", "b.*"))
    names = ["label__output", "prediction", "probability"]
    for half in (both.iloc[:, 1:4], both.iloc[:, 4:7]):
        _assert_frames_equal(half, expect, names)


def test_text_preprocessing_travels_inside(spark, mlflow_tracking):
    """A ``transformation_fn`` that turns a string into features runs inside the pyfunc as in transform."""
    import mlflow

    def featurize(pdf):
        vocab = "abcdefgh"
        return pd.DataFrame({"text": [np.array([t.count(c) for c in vocab], dtype=np.float32) for t in pdf["text"]]})

    texts = ["a bad cab", "hedge", "", "gggg fed", "ace", "bead fade cafe"] * 3
    df = spark.createDataFrame([(i, t) for i, t in enumerate(texts)], "id long, text string").repartition(2)
    model = TorchModel(model=_mlp(n_in=8, n_out=1, seed=4), feature_cols=["text"], label_cols=["score"],
                       transformation_fn=featurize, batch_size=4)
    expect = _sorted(model.transform(df))
    info = model.log_mlflow(input_example=df)
    loaded = mlflow.pyfunc.load_model(info.model_uri)
    assert repr(loaded.metadata.get_input_schema()) == "['text': string (required)]"  # strings: MLflow's columns
    got = loaded.predict(pd.DataFrame({"text": texts}))
    assert list(got.columns) == ["score__output"]
    np.testing.assert_allclose(got["score__output"].to_numpy(), expect["score__output"].to_numpy(), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.slow  # TensorFlow in the Spark Python workers
def test_keras_pyfunc_and_spark_udf_equal_transform(spark, mlflow_tracking):
    import keras
    import mlflow
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F  # noqa: N812

    from spark_hvd.estimators import KerasModel

    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    net = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(8, activation="tanh")(inputs)))
    model = KerasModel(model=net, feature_cols=["features"], label_cols=["y"], batch_size=8)
    df = _vector_df(spark, n=25, seed=3)
    info = model.log_mlflow(input_example=df)
    expect = _sorted(model.transform(df))
    arrays = pd.DataFrame({"features": [v.toArray().tolist() for v in expect["features"]]})
    got = mlflow.pyfunc.load_model(info.model_uri).predict(arrays)
    _assert_frames_equal(got, expect, ["y__output"])
    _assert_frames_equal(_sorted(KerasModel.load_mlflow(info.model_uri).transform(df)), expect, ["y__output"])
    udf = _spark_udf_or_skip()(spark, info.model_uri, env_manager="local", result_type="y__output array<float>")
    scored = df.withColumn("features", vector_to_array("features")).withColumn("out", udf(F.struct("features")))
    _assert_frames_equal(_sorted(scored.select("id", "out.*")), expect, ["y__output"])


def test_image_bytes_lightning_and_export_from_a_spark_frame(spark, mlflow_tracking, tmp_path):
    """Image bytes decoded by a transformation_fn: a LightningModel's pyfunc equals its transform; export takes
    its example from a Spark DataFrame of raw rows through the same preprocessing."""
    import lightning.pytorch as pl
    import mlflow

    from spark_hvd.estimators import LightningModel
    from spark_hvd.estimators.common.export import run_onnx  # noqa: F401 - the module imports without onnx

    def _decode_images(pdf):  # local, so that it travels by value to the Spark workers
        """Raw 4x4 grayscale bytes -> float arrays in [0, 1] (an image decoder of the simplest kind)."""
        return pd.DataFrame({"image": [np.frombuffer(b, dtype=np.uint8).reshape(4, 4).astype(np.float32) / 255.0
                                       for b in pdf["image"]]})

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(5)
            self.lin = torch.nn.Linear(16, 2)

        def forward(self, x):
            return self.lin(x.flatten(1))

    images = [np.random.default_rng(i).integers(0, 256, 16, dtype=np.uint8).tobytes() for i in range(12)]
    df = spark.createDataFrame([(i, b) for i, b in enumerate(images)], "id long, image binary").repartition(2)
    model = LightningModel(model=Classifier().eval(), feature_cols=["image"], label_cols=["label"],
                           transformation_fn=_decode_images, batch_size=5, metadata={"classifier": "logits"})
    expect = _sorted(model.transform(df))
    info = model.log_mlflow(input_example=df)
    got = mlflow.pyfunc.load_model(info.model_uri).predict(pd.DataFrame({"image": images}))
    _assert_frames_equal(got, expect, ["label__output", "prediction", "probability"])

    manifest = model.export(str(tmp_path / "ts"), format="torchscript", example=df)
    assert manifest["inputs"][0]["shape"] == [None, 4, 4]
    assert manifest["preprocessing"] == {"transformation_fn": True, "collate_fn": False}
    scripted = torch.jit.load(str(tmp_path / "ts" / "model.pt"))
    decoded = torch.from_numpy(np.stack(_decode_images(pd.DataFrame({"image": images}))["image"].to_list()))
    np.testing.assert_allclose(scripted(decoded).detach().numpy(), np.stack(expect["label__output"]), rtol=1e-5,
                               atol=1e-6)


def test_array_cells_become_the_arrow_list_column_of_the_slow_path():
    """``frame_to_table``'s fast path (1-D numeric numpy cells, as ``spark_udf`` hands them over) builds the same
    Arrow column as converting each cell to a list; anything else takes the per-cell path."""
    import pyarrow as pa

    from spark_hvd.estimators.common.pyfunc import _as_list, _flat_list_array

    rng = np.random.default_rng(0)
    for cells in ([np.arange(3, dtype=np.float32), np.arange(2, dtype=np.float32)], [np.arange(4), np.arange(0)],
                  [rng.standard_normal(64) for _ in range(5)], [np.arange(3, dtype=np.uint8)]):
        fast = _flat_list_array(cells)
        assert fast is not None and fast.equals(pa.array([_as_list(v) for v in cells])), (fast, cells)
    for cells in ([np.zeros((2, 2))], [[1.0], [2.0]], [np.arange(2), np.arange(2.0)], [np.arange(2), None], []):
        assert _flat_list_array(cells) is None


def test_tensor_schema_for_float_columns_only():
    """``log_mlflow``'s signature: float scalars and fixed-shape float arrays as MLflow tensors (float64); bytes,
    strings, integers (MLflow would cast a float given for them), ragged or mixed columns keep MLflow's column
    schema (None here). The dict of arrays MLflow then hands ``predict`` makes the same model inputs as the frame
    it came from."""
    from spark_hvd.estimators.common.arrow import feature_to_numpy
    from spark_hvd.estimators.common.pyfunc import arrays_to_table, frame_to_table, tensor_schema

    rng = np.random.default_rng(0)
    specs = [{"name": "x", "kind": "vector"}, {"name": "img", "kind": "array", "shape": [2, 3]},
             {"name": "n", "kind": "scalar"}]
    frame = pd.DataFrame({"x": list(rng.random((3, 4), dtype=np.float32)), "img": [rng.random((2, 3))] * 3,
                          "n": np.arange(3.0)})
    schema = tensor_schema(specs, frame)
    assert repr(schema) == ("['x': Tensor('float64', (-1, 4)), 'img': Tensor('float64', (-1, 2, 3)), "
                            "'n': Tensor('float64', (-1,))]")
    arrays = {"x": np.stack(frame["x"].to_list()), "img": np.stack(frame["img"].to_list()), "n": frame["n"].to_numpy()}
    by_frame, by_arrays = frame_to_table(specs, frame), arrays_to_table(specs, arrays)
    for s in specs:
        np.testing.assert_array_equal(feature_to_numpy(by_arrays[s["name"]], s["name"], None, s.get("shape")),
                                      feature_to_numpy(by_frame[s["name"]], s["name"], None, s.get("shape")))
    for name, column, kind in (("b", [b"ab", b"cd"], "binary"), ("t", ["a", "b"], "string"),
                               ("r", [np.arange(2.0), np.arange(3.0)], "array"), ("s", ["a", "b"], "scalar"),
                               ("o", [[1.0, 2.0], ["a", "b"]], "array"), ("g", [[1.0], [2.0]], "ragged"),
                               ("i", [np.arange(2), np.arange(2)], "array"), ("k", np.arange(2), "scalar")):
        assert tensor_schema([{"name": name, "kind": kind}], pd.DataFrame({name: column})) is None, name
    # one column that is not floats keeps the whole signature as columns
    mixed = pd.DataFrame({"x": list(rng.random((2, 4))), "t": ["a", "b"]})
    assert tensor_schema([{"name": "x", "kind": "vector"}, {"name": "t", "kind": "string"}], mixed) is None
