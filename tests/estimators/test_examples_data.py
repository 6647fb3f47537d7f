"""The data-kind examples run in the suite: an image classifier from a ``binaryFile`` DataFrame of real PNG files
(examples/image_classifier.py): fit -> transform -> save/load, with the decoder applied on the ranks and again by
``transform``; and the driver-side checks of the preprocessing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")
pytest.importorskip("sklearn")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # so that it can send its own classes by value (cloudpickle)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_text_classifier_tokenised_on_the_ranks(spark, tmp_path):
    """Strings -> a BPE tokenizer trained in seconds -> collate_fn padding variable-length ids on the ranks; the
    model's transform tokenises the held-out strings the same way."""
    pytest.importorskip("tokenizers")
    from spark_hvd.store import Store

    ex = _example("text_classifier")
    rows = ex.docstrings(per_library=300)
    cut = int(len(rows) * 0.8)
    tokenizer = ex.train_tokenizer([t for t, _ in rows[:cut]])
    lengths = {len(tokenizer.encode(t).ids) for t, _ in rows}
    assert len(lengths) > 20  # variable-length ids
    train = spark.createDataFrame(rows[:cut], "text string, label int")
    test = spark.createDataFrame(rows[cut:], "text string, label int")
    model = ex.build_estimator(Store.create(str(tmp_path / "store")), tokenizer, epochs=5).fit(train)
    out = model.transform(test).select("text", "label", "label__output").collect()
    acc = np.mean([int(np.argmax(r.label__output)) == r.label for r in out])
    assert acc >= 0.8, (acc, model.getHistory())  # two balanced classes: a broken pipeline stays near 0.5
    ids = ex.Tokenize(tokenizer)({"text": np.array([r.text for r in out], dtype=object)})["text"]
    with torch.no_grad():
        direct = model.getModel()(torch.from_numpy(ids)).numpy()
    np.testing.assert_allclose(np.array([r.label__output for r in out]), direct, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def images(spark, tmp_path_factory):
    ex = _example("image_classifier")
    directory = str(tmp_path_factory.mktemp("digits"))
    assert ex.write_digit_images(directory) == 1797
    return ex, ex.image_dataframe(spark, directory)


@pytest.mark.slow
def test_image_classifier_fit_transform_save_load(images, tmp_path):
    from spark_hvd.data.decode import decode_images
    from spark_hvd.estimators import TorchModel
    from spark_hvd.store import Store

    ex, df = images
    train, test = df.filter("NOT holdout"), df.filter("holdout").limit(120)
    model = ex.build_estimator(Store.create(str(tmp_path / "store")), epochs=4).fit(train)
    scored = model.transform(test).select("content", "label", "label__output").collect()
    acc = np.mean([int(np.argmax(r.label__output)) == r.label for r in scored])
    assert acc >= 0.85, (acc, model.getHistory())  # 10 classes: chance is 0.1, a scrambled decode stays far below

    # transform on the raw images equals the model called on the decoded tensors
    decoded = decode_images([r.content for r in scored], ex.SIZE, "L", [0.5], [0.5])
    with torch.no_grad():
        direct = model.getModel()(torch.from_numpy(decoded)).numpy()
    np.testing.assert_allclose(np.array([r.label__output for r in scored]), direct, rtol=1e-4, atol=1e-5)

    model.write().overwrite().save(str(tmp_path / "model"))
    loaded = TorchModel.load(str(tmp_path / "model"))
    assert repr(loaded.getTransformationFn()) == repr(model.getTransformationFn())
    again = loaded.transform(test).select("label__output").collect()
    np.testing.assert_allclose(np.array([r.label__output for r in again]), direct, rtol=1e-4, atol=1e-5)


def test_preprocessing_errors_are_raised_on_the_driver(images, tmp_path):
    import pandas as pd

    from spark_hvd.data.transform_check import TransformationFnError
    from spark_hvd.store import Store

    ex, df = images
    small = df.limit(40)
    est = ex.build_estimator(Store.create(str(tmp_path / "store")), epochs=1)

    def ragged(frame: pd.DataFrame) -> pd.DataFrame:  # rows of different shapes
        frame = frame.copy()
        frame["content"] = [np.zeros(3 + i % 2, np.float32) for i in range(len(frame))]
        return frame

    decoder = est.getTransformationFn()

    def drops_label(frame: pd.DataFrame) -> pd.DataFrame:
        return decoder(frame).drop(columns=["label"])

    with pytest.raises(TransformationFnError, match="column 'content' whose rows differ in shape"):
        est.copy({est.transformation_fn: ragged}).fit(small)
    with pytest.raises(TransformationFnError, match="returned no column 'label'"):
        est.copy({est.transformation_fn: drops_label}).fit(small)
    with pytest.raises(TransformationFnError, match="'content' is binary: the model needs numbers"):
        est.copy({est.transformation_fn: None}).fit(small)
    with pytest.raises(TransformationFnError, match="'content' as bytes values, not numbers"):
        est.copy({est.transformation_fn: lambda frame: frame}).fit(small)


def test_string_categories_through_string_indexer(spark):
    """A string category column goes through StringIndexer in the Pipeline: its double output (nominal in the
    Spark ML metadata) is accepted as class indices, where a plain double label is refused."""
    from pyspark.ml.feature import StringIndexer

    from spark_hvd.estimators import TorchEstimator

    df = spark.createDataFrame([([0.1, 0.2], "cat"), ([0.3, 0.1], "dog"), ([0.5, 0.5], "cat")],
                               "x array<float>, species string")
    indexed = StringIndexer(inputCol="species", outputCol="label").fit(df).transform(df)
    assert sorted({r.label for r in indexed.collect()}) == [0.0, 1.0]
    est = TorchEstimator(loss="cross_entropy", feature_cols=["x"], label_cols=["label"])
    est._check_label_types(indexed)  # no error: whole class indices
    with pytest.raises(ValueError, match="label column 'label' is double but its loss takes class indices"):
        est._check_label_types(indexed.withColumn("label", indexed["label"] + 0.0))


@pytest.mark.slow
def test_keras_image_classifier_transform_equals_the_model_on_decoded_images(images, tmp_path):
    """The same binaryFile images through KerasEstimator with a channels-last ImageDecoder."""
    keras = pytest.importorskip("keras")
    from spark_hvd.data.decode import ImageDecoder, decode_images
    from spark_hvd.estimators import KerasEstimator
    from spark_hvd.store import Store

    ex, df = images
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16, 16, 1)), keras.layers.Conv2D(8, 3, activation="relu"),
                              keras.layers.MaxPooling2D(), keras.layers.Flatten(), keras.layers.Dense(10)])
    decoder = ImageDecoder("content", size=ex.SIZE, mode="L", channels_last=True)
    est = KerasEstimator(num_proc=2, store=Store.create(str(tmp_path / "store")), model=model,
                         optimizer=keras.optimizers.Adam(learning_rate=1e-2),
                         loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                         feature_cols=["content"], label_cols=["label"], batch_size=32, epochs=3, random_seed=1,
                         partitions_per_process=2, transformation_fn=decoder, verbose=0)
    fitted = est.fit(df.filter("NOT holdout"))
    scored = fitted.transform(df.filter("holdout").limit(80)).select("content", "label", "label__output").collect()
    acc = np.mean([int(np.argmax(r.label__output)) == r.label for r in scored])
    assert acc >= 0.6, (acc, fitted.getHistory())  # chance is 0.1
    decoded = decode_images([r.content for r in scored], ex.SIZE, "L", channels_last=True)
    direct = np.asarray(fitted.getModel()(decoded))
    np.testing.assert_allclose(np.array([r.label__output for r in scored]), direct, rtol=1e-4, atol=1e-4)


def test_transform_inputs_pad_ragged_rows_as_training_does():
    """transform's model inputs for a ragged feature (token ids of varying length) without preprocessing: padded
    per Arrow batch and cast as the training reader does; with ragged='list', one array per row to collate_fn."""
    import pyarrow as pa

    from spark_hvd.estimators.common.model import model_inputs

    rb = pa.record_batch({"ids": pa.array([[3, 1], [], [7, 8, 9]], pa.list_(pa.int32())), "x": [1.0, 2.0, 3.0]})
    specs = [{"name": "ids", "dtype": "int64", "shape": [-1], "kind": "ragged"},
             {"name": "x", "dtype": "float32", "shape": [], "kind": "scalar"}]
    ids, x = model_inputs(rb, [0, 1], specs)
    assert ids.dtype == np.int64 and ids.tolist() == [[3, 1, 0], [0, 0, 0], [7, 8, 9]]
    assert x.dtype == np.float32 and x.tolist() == [1.0, 2.0, 3.0]
    seen = {}

    def collate(batch):
        seen.update(batch)
        return {"ids": np.array([len(r) for r in batch["ids"]]), "x": batch["x"]}

    lengths, _ = model_inputs(rb, [0, 1], specs, collate_fn=collate, ragged="list")
    assert lengths.tolist() == [2, 0, 3] and [r.tolist() for r in seen["ids"]] == [[3, 1], [], [7, 8, 9]]


@pytest.mark.slow
def test_ragged_token_ids_through_fit_and_transform(spark, tmp_path):
    """An array<int> column of varying length goes through fit without any preprocessing (padded per batch by
    the reader), and transform gives what the model gives on the padded ids."""
    from spark_hvd.estimators import TorchEstimator
    from spark_hvd.store import Store

    ex = _example("text_classifier")
    rng = np.random.default_rng(4)
    rows = []
    for _ in range(240):
        ids = rng.integers(2, 50, size=int(rng.integers(1, 12))).tolist()
        label = int(rng.random() < 0.5)
        if label:
            ids[int(rng.integers(0, len(ids)))] = 1  # the class is marked by id 1 somewhere in the row
        rows.append((ids, label))
    df = spark.createDataFrame(rows, "ids array<int>, label int")
    torch.manual_seed(0)
    net = ex.MeanEmbedding(50, 16)
    est = TorchEstimator(num_proc=2, store=Store.create(str(tmp_path / "store")), model=net,
                         optimizer=torch.optim.Adam(net.parameters(), lr=3e-2), loss="cross_entropy",
                         metrics=["accuracy"], feature_cols=["ids"], label_cols=["label"], batch_size=16, epochs=4,
                         random_seed=1, partitions_per_process=2, verbose=0)
    model = est.fit(df)
    hist = model.getHistory()
    assert hist["accuracy"][-1] > 0.75, hist  # chance is 0.5
    out = model.transform(df.limit(30)).select("ids", "label__output").collect()
    longest = max(len(r.ids) for r in out)
    padded = np.zeros((len(out), longest), np.int64)
    for i, r in enumerate(out):
        padded[i, :len(r.ids)] = r.ids
    with torch.no_grad():
        direct = model.getModel()(torch.from_numpy(padded)).numpy()
    np.testing.assert_allclose(np.array([r.label__output for r in out]), direct, rtol=1e-4, atol=1e-5)
