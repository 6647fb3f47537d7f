"""TorchModel.transform against the module called directly, params, and Pipeline persistence of the model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spark_hvd.estimators import TorchModel

pytestmark = pytest.mark.spark


def _trained_net(n_in: int = 4, n_out: int = 1, seed: int = 0) -> torch.nn.Module:
    """A small MLP trained a few steps in process (so its weights are not the init ones)."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(n_in, 16), torch.nn.Tanh(), torch.nn.Linear(16, n_out))
    x = torch.randn(256, n_in)
    y = x.sum(1, keepdim=True).repeat(1, n_out)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(20):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    return net.eval()


def _vector_df(spark, n: int = 300, n_in: int = 4, seed: int = 1):
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, n_in))
    rows = [(i, Vectors.dense(x[i].tolist()), float(x[i].sum())) for i in range(n)]
    return spark.createDataFrame(rows, ["id", "features", "y"]).repartition(3), x


def test_transform_vector_scalar_output_matches_module(spark):
    net = _trained_net()
    df, _ = _vector_df(spark)
    model = TorchModel(model=net, feature_cols=["features"], label_cols=["y"], batch_size=7)
    out = model.transform(df)
    assert dict(out.dtypes)["y__output"] == "double"
    assert out.columns == ["id", "features", "y", "y__output"]
    rows = sorted(out.collect(), key=lambda r: r.id)
    x = np.array([r.features.toArray() for r in rows], dtype=np.float32)
    with torch.no_grad():
        expect = net(torch.from_numpy(x)).numpy().reshape(-1)
    got = np.array([r.y__output for r in rows])
    np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-6)


def test_transform_array_features_vector_output_without_labels(spark):
    net = _trained_net(n_in=3, n_out=2, seed=3)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((50, 3)).astype(np.float32)
    df = spark.createDataFrame([(i, x[i].tolist()) for i in range(50)], "id long, arr array<float>")
    model = TorchModel(model=net, feature_cols=["arr"], label_cols=["target"])
    model.setOutputCols(["pred"])
    out = model.transform(df)
    assert dict(out.dtypes)["pred"] == "array<float>"
    rows = sorted(out.collect(), key=lambda r: r.id)
    with torch.no_grad():
        expect = net(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.array([r.pred for r in rows]), expect, rtol=1e-5, atol=1e-6)


def test_transform_two_inputs_two_outputs(spark):
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 1)
            self.b = torch.nn.Linear(1, 2)

        def forward(self, v, s):
            h = self.a(v) + s.unsqueeze(1)
            return h, self.b(h)

    torch.manual_seed(0)
    net = TwoHeads().eval()
    rng = np.random.default_rng(4)
    x = rng.standard_normal((40, 3))
    s = rng.standard_normal(40)
    df = spark.createDataFrame([(x[i].tolist(), float(s[i])) for i in range(40)], "v array<double>, s double")
    out = TorchModel(model=net, feature_cols=["v", "s"], label_cols=["l1", "l2"], batch_size=16).transform(df)
    assert [t for _, t in out.dtypes[-2:]] == ["double", "array<float>"]
    rows = out.collect()
    got_v = np.array([r.v for r in rows], dtype=np.float32)
    got_s = np.array([r.s for r in rows], dtype=np.float32)
    with torch.no_grad():
        e1, e2 = net(torch.from_numpy(got_v), torch.from_numpy(got_s))
    np.testing.assert_allclose([r.l1__output for r in rows], e1.numpy().reshape(-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose([r.l2__output for r in rows], e2.numpy(), rtol=1e-5, atol=1e-6)


def test_transform_errors_name_the_column(spark):
    df, _ = _vector_df(spark, n=10)
    model = TorchModel(model=_trained_net(), feature_cols=["featurs"], label_cols=["y"])
    with pytest.raises(ValueError, match="featurs"):
        model.transform(df)
    model = TorchModel(model=_trained_net(), feature_cols=["features"], label_cols=["y"], output_cols=["id"])
    with pytest.raises(ValueError, match="already exist"):
        model.transform(df)


def test_params_spark_style():
    model = TorchModel(batch_size=8)
    assert model.getBatchSize() == 8
    assert model.setBatchSize(16) is model and model.getBatchSize() == 16
    model.setLabelCols("y")
    assert model.getLabelCols() == ["y"] and model.getOutputCols() == ["y__output"]
    text = model.explainParams()
    assert "output_cols" in text and "batch_size" in text
    with pytest.raises(TypeError):
        model.setBatchSize("many")


def test_pipeline_model_save_load_transform(spark, tmp_path):
    from pyspark.ml import PipelineModel
    from pyspark.ml.feature import VectorAssembler

    rng = np.random.default_rng(5)
    x = rng.standard_normal((60, 4))
    df = spark.createDataFrame([tuple(float(v) for v in row) for row in x], ["a", "b", "c", "d"])
    assembler = VectorAssembler(inputCols=["a", "b", "c", "d"], outputCol="features")
    tm = TorchModel(model=_trained_net(), feature_cols=["features"], label_cols=["y"], history={"loss": [1.0, 0.5]},
                    run_id="r1", metadata={"output_shapes": [[1]]})
    pm = PipelineModel(stages=[assembler, tm])
    before = pm.transform(df).select("a", "y__output").collect()
    path = str(tmp_path / "pm")
    pm.save(path)
    loaded = PipelineModel.load(path)
    stage = loaded.stages[1]
    assert isinstance(stage, TorchModel) and stage.uid == tm.uid
    assert stage.getHistory() == {"loss": [1.0, 0.5]} and stage.getRunId() == "r1"
    after = loaded.transform(df).select("a", "y__output").collect()
    assert before == after


def test_output_shapes_inferred_once_per_model(spark, monkeypatch):
    """A model without recorded output shapes runs one row on the driver once, not on every transform."""
    df, _ = _vector_df(spark, n=20)
    model = TorchModel(model=_trained_net(), feature_cols=["features"], label_cols=["y"])
    calls = []
    infer = TorchModel._infer_output_shapes

    def counting(self, *args):
        calls.append(1)
        return infer(self, *args)

    monkeypatch.setattr(TorchModel, "_infer_output_shapes", counting)
    first = model.transform(df).select("y__output").collect()
    second = model.transform(df).select("y__output").collect()
    assert len(calls) == 1 and sorted(first) == sorted(second)
    model.setModel(_trained_net(seed=7))  # another model: inferred again
    model.transform(df)
    assert len(calls) == 2


def test_predict_batches_equals_one_call():
    """Batches of 7 rows through ``_predict_batches`` give what one call of the module gives, for each output."""
    net = _trained_net(n_in=3, n_out=2, seed=2)
    x = np.random.default_rng(0).standard_normal((50, 3)).astype(np.float32)
    x.setflags(write=False)  # as Arrow hands them
    got = TorchModel._predict_batches(net, [x], 7)
    with torch.no_grad():
        expect = net(torch.from_numpy(x.copy())).numpy()
    assert len(got) == 1 and got[0].shape == (50, 2)
    np.testing.assert_allclose(got[0], expect, rtol=1e-6, atol=1e-6)
    assert TorchModel._predict_batches(net, [x[:0]], 7)[0].shape == (0, 2)


def test_use_gpu_on_a_cpu_worker_gives_the_cpu_result(spark):
    """``setUseGpu(True)`` where no GPU is visible: transform still runs (on the CPU) and gives the same values."""
    net = _trained_net()
    df, _ = _vector_df(spark, n=60)
    model = TorchModel(model=net, feature_cols=["features"], label_cols=["y"], batch_size=16)
    assert model.getUseGpu() is False
    cpu = sorted((r.id, r.y__output) for r in model.transform(df).collect())
    assert model.setUseGpu(True) is model and model.getUseGpu() is True
    gpu = sorted((r.id, r.y__output) for r in model.transform(df).collect())
    if not torch.cuda.is_available():
        assert gpu == cpu
    else:
        np.testing.assert_allclose([v for _, v in gpu], [v for _, v in cpu], rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_transform_equals_cpu_transform(spark):
    """On a machine with CUDA: the module is loaded on the GPU for transform, and its outputs equal the CPU ones."""
    net = _trained_net(n_in=3, n_out=2, seed=5)
    x = np.random.default_rng(3).standard_normal((40, 3)).astype(np.float32)
    loaded = TorchModel._load_for_inference(TorchModel._serialize_model(net), use_gpu=True)
    assert next(loaded.parameters()).device.type == "cuda"
    np.testing.assert_allclose(TorchModel._predict_batches(loaded, [x], 16)[0],
                               TorchModel._predict_batches(net, [x], 16)[0], rtol=1e-4, atol=1e-5)
    df = spark.createDataFrame([(i, x[i].tolist()) for i in range(40)], "id long, arr array<float>")
    model = TorchModel(model=net, feature_cols=["arr"], label_cols=["t"], batch_size=16)
    cpu = sorted((r.id, r.t__output) for r in model.transform(df).collect())
    gpu = sorted((r.id, r.t__output) for r in model.setUseGpu(True).transform(df).collect())
    np.testing.assert_allclose(np.array([v for _, v in gpu]), np.array([v for _, v in cpu]), rtol=1e-4, atol=1e-5)


def test_classifier_columns_feed_spark_evaluators(spark):
    """A classifier's model (metadata 'classifier') adds Spark's prediction (arg-max, double) and probability
    (softmax Vector) beside the raw output, equal to the module called directly; binary models get sigmoid."""
    from pyspark.ml.evaluation import BinaryClassificationEvaluator, MulticlassClassificationEvaluator

    net = _trained_net(n_out=3, seed=4)
    df, x = _vector_df(spark, n=60)
    with torch.no_grad():
        logits = net(torch.from_numpy(x.astype(np.float32)))
    labels = logits.argmax(1).numpy()
    rows = [(i, r.features, int(labels[i])) for i, r in enumerate(sorted(df.collect(), key=lambda r: r.id))]
    df = spark.createDataFrame(rows, ["id", "features", "label"])
    model = TorchModel(model=net, feature_cols=["features"], label_cols=["label"],
                       metadata={"classifier": "logits"})
    out = model.transform(df)
    assert out.columns == ["id", "features", "label", "label__output", "prediction", "probability"]
    assert dict(out.dtypes)["prediction"] == "double"
    got = sorted(out.collect(), key=lambda r: r.id)
    np.testing.assert_array_equal([r.prediction for r in got], labels.astype(float))
    np.testing.assert_allclose(np.array([r.probability.toArray() for r in got]),
                               torch.softmax(logits, 1).numpy(), rtol=1e-5, atol=1e-6)
    assert MulticlassClassificationEvaluator(metricName="accuracy").evaluate(out) == 1.0

    model.setPredictionCol("").setProbabilityCol("proba")
    assert model.transform(df).columns[-1] == "proba" and "prediction" not in model.transform(df).columns

    binary = TorchModel(model=_trained_net(), feature_cols=["features"], label_cols=["label"],
                        metadata={"classifier": "binary_logits"})
    out = binary.transform(df.withColumn("label", (df["label"] > 0).cast("double")))
    first = out.orderBy("id").first()
    p1 = 1.0 / (1.0 + np.exp(-first.label__output))
    np.testing.assert_allclose(first.probability.toArray(), [1.0 - p1, p1], rtol=1e-6)
    assert first.prediction == float(first.label__output > 0)
    assert 0.0 <= BinaryClassificationEvaluator(rawPredictionCol="probability").evaluate(out) <= 1.0


def test_classifier_columns_in_numpy_equal_the_spark_sql_ones(spark):
    """``transform`` computes prediction and probability in numpy inside its Arrow function; they equal the Spark
    SQL expressions (``add_classifier_columns``) on the same output column, for each kind: ties (the first
    class), large logits, one value per row (a double column) and per-class arrays (``array<float>``)."""
    from spark_hvd.estimators.common.classifier import KINDS, add_classifier_columns, classifier_arrays

    rng = np.random.default_rng(6)
    multi = rng.standard_normal((20, 4)).astype(np.float32) * 30
    multi[0] = [1.0, 3.0, 3.0, -2.0]  # a tie: the first of the two
    multi[1] = [500.0, 499.0, -500.0, 0.0]  # exp would overflow without the shift
    probs = rng.random((20, 4)).astype(np.float32) + 0.01
    single = rng.standard_normal(20) * 3
    single[2] = 0.0
    unit = rng.random(20)
    unit[3] = 0.5
    df = spark.createDataFrame([(i, multi[i].tolist(), probs[i].tolist(), float(single[i]), float(unit[i]))
                                for i in range(20)],
                               "id long, logits array<float>, probs array<float>, bl double, bp double")
    cases = {"logits": ("logits", multi), "probabilities": ("probs", probs),
             "binary_logits": ("bl", single), "binary_probabilities": ("bp", unit)}
    assert set(cases) == set(KINDS)
    for kind, (col, _) in cases.items():
        df = add_classifier_columns(df, col, kind, f"{kind}_pred", f"{kind}_prob")
    rows = sorted(df.collect(), key=lambda r: r.id)
    for kind, (_, out) in cases.items():
        for vector in (True, False):
            prediction, probability = classifier_arrays(out, kind, vector)
            probability = probability.field("values") if vector else probability
            np.testing.assert_array_equal(prediction.to_numpy(), [r[f"{kind}_pred"] for r in rows], err_msg=kind)
            np.testing.assert_allclose(np.array(probability.to_pylist()),
                                       np.array([r[f"{kind}_prob"].toArray() for r in rows]), rtol=1e-13,
                                       atol=0, err_msg=kind)
