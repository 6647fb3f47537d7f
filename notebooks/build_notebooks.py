"""Write the notebooks of this directory from the cells below (edit here, then run this script).

    .venv/bin/python notebooks/build_notebooks.py              # write the .ipynb files, no outputs
    .venv/bin/python notebooks/build_notebooks.py --execute    # and run them, keeping the outputs (plots inline)

``tests/test_notebooks.py`` executes every notebook, so a broken one fails the test suite.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

SETUP = """\
import os
import sys

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")   # a laptop: Spark on loopback
os.environ["PYSPARK_PYTHON"] = sys.executable           # Spark's Python workers run this kernel's Python
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import io
import tempfile

import matplotlib

matplotlib.use("Agg")                                   # no display needed; figures are shown as PNG below
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from IPython.display import Image, display  # noqa: E402


def show(fig):
    \"\"\"Render a matplotlib figure into the notebook as a PNG.\"\"\"
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    plt.close(fig)
    display(Image(buf.getvalue()))
"""

SPARK = """\
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

spark = (SparkSession.builder.master("local[2]")          # two task slots -> two training processes
         .appName("spark_hvd notebook")
         .config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.shuffle.partitions", "4")
         .config("spark.sql.execution.arrow.pyspark.enabled", "true")   # fast pandas <-> Spark
         .getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
workdir = tempfile.mkdtemp(prefix="spark_hvd_nb_")
print(spark.version, workdir)
"""

DATA = """\
from sklearn.datasets import load_digits

digits = load_digits()                                   # 1797 images of 8x8 pixels, bundled with scikit-learn
pixels = [f"p{i}" for i in range(64)]
pdf = pd.DataFrame(digits.data / 16.0, columns=pixels)
pdf["label"] = digits.target.astype("int64")
df = spark.createDataFrame(pdf)
train_df, test_df = df.randomSplit([0.8, 0.2], seed=7)
train_df, test_df = train_df.cache(), test_df.cache()
print(train_df.count(), "training rows,", test_df.count(), "held out")

fig, axes = plt.subplots(1, 8, figsize=(8, 1.2))
for ax, image, label in zip(axes, digits.images, digits.target, strict=False):
    ax.imshow(image, cmap="gray_r")
    ax.set_title(int(label))
    ax.axis("off")
show(fig)
"""

CURVES = """\
history = fitted.stages[-1].getHistory()                # per epoch, averaged over the ranks
display(pd.DataFrame(history).rename_axis("epoch"))

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3))
epochs = range(1, len(history["loss"]) + 1)
ax1.plot(epochs, history["loss"], "o-", label="training")
ax1.plot(epochs, history["val_loss"], "o-", label="validation")
ax1.set(xlabel="epoch", ylabel="loss")
ax1.legend()
ax2.plot(epochs, history["accuracy"], "o-", label="training")
ax2.plot(epochs, history["val_accuracy"], "o-", label="validation")
ax2.set(xlabel="epoch", ylabel="accuracy")
ax2.legend()
show(fig)
"""

PREDICT = """\
from sklearn.metrics import confusion_matrix

predictions = fitted.transform(test_df)                   # adds label__output: one score per class
predictions = predictions.withColumn(
    "prediction", F.expr("array_position(label__output, array_max(label__output)) - 1"))
result = predictions.select("label", "prediction", "label__output").toPandas()
accuracy = float((result.label == result.prediction).mean())
print(f"held-out accuracy: {accuracy:.3f} on {len(result)} rows")

cm = confusion_matrix(result.label, result.prediction, labels=list(range(10)))
fig, ax = plt.subplots(figsize=(4.5, 4))
ax.imshow(cm, cmap="Blues")
for i in range(10):
    for j in range(10):
        if cm[i, j]:
            color = "white" if cm[i, j] > cm.max() / 2 else "black"
            ax.text(j, i, cm[i, j], ha="center", va="center", fontsize=7, color=color)
ax.set(xticks=range(10), yticks=range(10), xlabel="predicted", ylabel="true", title="confusion matrix (held-out rows)")
show(fig)
assert accuracy > 0.8, accuracy
"""

SAVE_LOAD = """\
from pyspark.ml import PipelineModel

path = os.path.join(workdir, "pipeline")
fitted.write().overwrite().save(path)
reloaded = PipelineModel.load(path)
before = np.stack(result["label__output"])                # the predictions made above
after = np.stack(reloaded.transform(test_df).select("label__output").toPandas()["label__output"])
print("reloaded Pipeline predicts the same:", np.allclose(before, after, rtol=1e-5, atol=1e-6))
"""

STOP = """\
import shutil

spark.stop()
shutil.rmtree(workdir, ignore_errors=True)
"""


def torch_notebook() -> nbformat.NotebookNode:
    cells = [
        new_markdown_cell(
            "# TorchEstimator on Spark, step by step\n\n"
            "Train a small torch MLP on scikit-learn's bundled digits with **two training processes** on an "
            "embedded Spark (`local[2]`), inside a Spark ML `Pipeline`; plot the training curves from "
            "`getHistory()`, predict held-out rows, draw the confusion matrix, save and reload the Pipeline. "
            "Runs offline in about a minute."),
        new_code_cell(SETUP),
        new_markdown_cell("## A local Spark\nOn a cluster, use its `SparkSession` instead "
                          "(see [docs/clusters.md](../docs/clusters.md))."),
        new_code_cell(SPARK),
        new_markdown_cell("## The data: 64 pixel columns and a label"),
        new_code_cell(DATA),
        new_markdown_cell(
            "## The estimator\n\n"
            "`TorchEstimator` takes the model, an optimizer built on its parameters (rebuilt on every rank), a "
            "loss, the columns, and a **store**: where the prepared Parquet data, the per-epoch checkpoints and "
            "the final model go (a local directory here; `dbfs:/…`, `hdfs://…`, `s3://…` on a cluster). "
            "The `VectorAssembler` turns the pixel columns into one `features` vector."),
        new_code_cell("""\
import torch
from pyspark.ml import Pipeline
from pyspark.ml.feature import VectorAssembler

from spark_hvd.estimators import TorchEstimator
from spark_hvd.store import Store

torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
estimator = TorchEstimator(
    num_proc=2,
    store=Store.create(os.path.join(workdir, "store")),
    model=net,
    optimizer=torch.optim.Adam(net.parameters(), lr=3e-3),
    loss="cross_entropy",
    metrics=["accuracy"],
    feature_cols=["features"],
    label_cols=["label"],
    batch_size=32,
    epochs=4,
    validation=0.1,
    random_seed=0,
    partitions_per_process=1,          # tiny data: one Parquet file per process
)
pipeline = Pipeline(stages=[VectorAssembler(inputCols=pixels, outputCol="features"), estimator])
"""),
        new_markdown_cell("## Fit\nOne line per epoch comes from rank 0 while it trains."),
        new_code_cell("fitted = pipeline.fit(train_df)\nfitted.stages[-1]"),
        new_markdown_cell("## Training and validation curves"),
        new_code_cell(CURVES),
        new_markdown_cell("## Predictions and the confusion matrix\n`transform` runs batched inference with "
                          "Arrow on the executors; the model is loaded once per Python worker."),
        new_code_cell(PREDICT),
        new_markdown_cell("## Save and reload the Pipeline"),
        new_code_cell(SAVE_LOAD),
        new_code_cell(STOP),
    ]
    return _notebook(cells)


def keras_notebook() -> nbformat.NotebookNode:
    cells = [
        new_markdown_cell(
            "# KerasEstimator on Spark, step by step\n\n"
            "The same task as `torch_estimator.ipynb` with a Keras 3 model (TensorFlow backend): two training "
            "processes on an embedded Spark (`local[2]`), a `Pipeline`, curves from `getHistory()`, a confusion "
            "matrix of the held-out predictions, save and reload."),
        new_code_cell(SETUP),
        new_code_cell(SPARK),
        new_markdown_cell("## The data"),
        new_code_cell(DATA),
        new_markdown_cell(
            "## The estimator\n\n"
            "The model travels to the training processes as `.keras` bytes; the optimizer is rebuilt from its "
            "config on every rank and wrapped in `spark_hvd.keras.DistributedOptimizer`. The learning rate is "
            "used as given (scale it yourself for larger `num_proc`)."),
        new_code_cell("""\
import keras
from pyspark.ml import Pipeline
from pyspark.ml.feature import VectorAssembler

from spark_hvd.estimators import KerasEstimator
from spark_hvd.store import Store

keras.utils.set_random_seed(0)
model = keras.Sequential([
    keras.Input(shape=(64,)),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(10, activation="softmax"),
])
estimator = KerasEstimator(
    num_proc=2,
    store=Store.create(os.path.join(workdir, "store")),
    model=model,
    optimizer=keras.optimizers.Adam(learning_rate=3e-3),
    loss="sparse_categorical_crossentropy",
    metrics=["accuracy"],
    feature_cols=["features"],
    label_cols=["label"],
    batch_size=32,
    epochs=4,
    validation=0.1,
    random_seed=0,
    partitions_per_process=1,
)
pipeline = Pipeline(stages=[VectorAssembler(inputCols=pixels, outputCol="features"), estimator])
"""),
        new_markdown_cell("## Fit"),
        new_code_cell("fitted = pipeline.fit(train_df)\nfitted.stages[-1]"),
        new_markdown_cell("## Training and validation curves"),
        new_code_cell(CURVES),
        new_markdown_cell("## Predictions and the confusion matrix\nThe model ends in a softmax, so "
                          "`label__output` holds the ten class probabilities of each row."),
        new_code_cell(PREDICT),
        new_markdown_cell("## Save and reload the Pipeline"),
        new_code_cell(SAVE_LOAD),
        new_code_cell(STOP),
    ]
    return _notebook(cells)


def horovod_notebook() -> nbformat.NotebookNode:
    cells = [
        new_markdown_cell(
            "# The Horovod-style API without Spark\n\n"
            "`spark_hvd.torch` is Horovod's torch API (`import spark_hvd.torch as hvd`). This notebook runs "
            "[`examples/horovod_torch.py`](../examples/horovod_torch.py) as **two processes** with the launcher "
            "`spark-hvd-run` (`DistributedOptimizer`, `broadcast_parameters`, `broadcast_optimizer_state`, "
            "`allreduce`, `allgather`), records a **timeline** of the collectives, and draws it."),
        new_code_cell("""\
import collections
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from IPython.display import Image, display  # noqa: E402

script = Path("..", "examples", "horovod_torch.py").resolve()
print(script.read_text()[:1500])
"""),
        new_markdown_cell(
            "## Launch two ranks\n\n"
            "In a shell this is `SPARK_HVD_TIMELINE=/tmp/timeline.json spark-hvd-run -np 2 python "
            "examples/horovod_torch.py --epochs 3`; here the launcher runs as `python -m spark_hvd.runner` with "
            "this kernel's Python. Output lines are prefixed with the rank."),
        new_code_cell("""\
timeline = os.path.join(tempfile.mkdtemp(prefix="spark_hvd_timeline_"), "timeline.json")
env = dict(os.environ, SPARK_HVD_TIMELINE=timeline, OMP_NUM_THREADS="1")
proc = subprocess.run(
    [sys.executable, "-m", "spark_hvd.runner", "-np", "2", "--timeout", "300",
     sys.executable, str(script), "--epochs", "3"],
    env=env, capture_output=True, text=True, timeout=400)
print(proc.stdout)
assert proc.returncode == 0, proc.stderr[-3000:]
assert "weights identical on every rank: True" in proc.stdout
"""),
        new_markdown_cell(
            "## The timeline\n\n"
            "A Chrome-trace JSON file: open it at <https://ui.perfetto.dev> or `chrome://tracing`. Each tensor "
            "has a row; its events are the wait for negotiation, the negotiation (until every rank has the "
            "tensor), copies into and out of the fusion buffer, and the collective."),
        new_code_cell("""\
events = json.load(open(timeline))
spans = [e for e in events if e.get("ph") == "X"]
print(len(spans), "events:", dict(collections.Counter(e["name"] for e in spans)))
total_ms = collections.defaultdict(float)
for e in spans:
    total_ms[e["name"]] += e["dur"] / 1000
print({k: round(v, 1) for k, v in total_ms.items()}, "ms in all")
"""),
        new_code_cell("""\
rows = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
colors = {"WAIT_FOR_NEGOTIATION": "#cccccc", "NEGOTIATE": "#f4a261", "ALLREDUCE": "#2a9d8f",
          "BROADCAST": "#e76f51", "ALLGATHER": "#264653", "MEMCPY_IN_FUSION_BUFFER": "#e9c46a",
          "MEMCPY_OUT_FUSION_BUFFER": "#e9c46a", "ROUND": "#8ab17d"}
last = max(e["ts"] + e["dur"] for e in spans)
window = [e for e in spans if e["ts"] >= last - 300_000]        # the last 0.3 s of the job
tids = sorted({e["tid"] for e in window})
fig, ax = plt.subplots(figsize=(10, 0.35 * len(tids) + 1))
for e in window:
    y = tids.index(e["tid"])
    ax.barh(y, e["dur"] / 1000, left=(e["ts"] - last) / 1000, color=colors.get(e["name"], "#999999"), height=0.8)
ax.set_yticks(range(len(tids)), [rows.get(t, str(t))[:40] for t in tids], fontsize=7)
ax.set_xlabel("ms before the end of the job")
handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
ax.legend(handles, colors.keys(), fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
buf = io.BytesIO()
fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
plt.close(fig)
display(Image(buf.getvalue()))
"""),
        new_markdown_cell(
            "## The same API in this process\n\n"
            "Without a launcher, `hvd.init()` makes a job of one process, so Horovod code runs (and can be "
            "debugged) in a notebook; the collectives then return their input."),
        new_code_cell("""\
import torch

import spark_hvd.torch as hvd

hvd.init()
print("rank", hvd.rank(), "of", hvd.size())
print(hvd.allreduce(torch.arange(4.0)), hvd.allgather(torch.ones(2, 3)).shape)
hvd.shutdown()
"""),
    ]
    return _notebook(cells)


IMAGES_WRITE = """\
from PIL import Image as PILImage
from sklearn.datasets import load_digits

digits = load_digits()                                   # 1797 handwritten digits, bundled with scikit-learn
png_dir = os.path.join(workdir, "png")
for n, (image, label) in enumerate(zip(digits.images, digits.target, strict=True)):
    folder = os.path.join(png_dir, str(int(label)))      # <digit>/<n>.png: the label is the folder's name
    os.makedirs(folder, exist_ok=True)
    grey = PILImage.fromarray((image * (255 / 16)).astype(np.uint8), mode="L").resize((32, 32), PILImage.BILINEAR)
    grey.save(os.path.join(folder, f"{n:04d}.png"))

images = (spark.read.format("binaryFile").option("pathGlobFilter", "*.png").option("recursiveFileLookup", "true")
          .load(png_dir)
          .withColumn("label", F.regexp_extract("path", r"/(\\d)/[^/]+$", 1).cast("int"))
          .withColumn("holdout", F.regexp_extract("path", r"/(\\d+)\\.png$", 1).cast("int") % 5 == 0)
          .select("path", "content", "label", "holdout")
          .coalesce(4))
train_images, test_images = images.filter("NOT holdout").cache(), images.filter("holdout").cache()
print(train_images.count(), "training images,", test_images.count(), "held out")
images.printSchema()

sample = train_images.limit(8).collect()                 # the bytes of PNG files, drawn on the driver here only
fig, axes = plt.subplots(1, 8, figsize=(8, 1.3))
for ax, row in zip(axes, sample, strict=False):
    ax.imshow(PILImage.open(io.BytesIO(row.content)), cmap="gray")
    ax.set_title(f"{row.label} ({len(row.content)} B)", fontsize=8)
    ax.axis("off")
show(fig)
"""

IMAGES_ESTIMATOR = """\
import torch

from spark_hvd.data.decode import ImageDecoder
from spark_hvd.estimators import TorchEstimator
from spark_hvd.store import Store

torch.manual_seed(0)
net = torch.nn.Sequential(
    torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
    torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
    torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 10))
decoder = ImageDecoder("content", size=(16, 16), mode="L", mean=[0.5], std=[0.5])   # bytes -> 1 x 16 x 16 floats
estimator = TorchEstimator(
    num_proc=2,
    store=Store.create(os.path.join(workdir, "store")),
    model=net,
    optimizer=torch.optim.Adam(net.parameters(), lr=3e-3),
    loss="cross_entropy",
    metrics=["accuracy"],
    feature_cols=["content"],          # the encoded bytes: decoded on the ranks, not on the driver
    label_cols=["label"],
    transformation_fn=decoder,         # run on each rank's reader pool, and again by transform
    train_reader_num_workers=2,        # reader_pool_type="process" runs it in worker processes instead
    batch_size=32,
    epochs=5,
    random_seed=1,
    partitions_per_process=2,
)
model = estimator.fit(train_images)
history = model.getHistory()
fig, ax = plt.subplots(figsize=(4.5, 2.5))
ax.plot(history["loss"], label="loss")
ax.plot(history["accuracy"], label="accuracy")
ax.set_xlabel("epoch")
ax.legend()
show(fig)
"""

IMAGES_PREDICT = """\
scored = model.transform(test_images).select("content", "label", "label__output").toPandas()
scored["prediction"] = [int(np.argmax(o)) for o in scored.label__output]
print(f"held-out accuracy: {(scored.prediction == scored.label).mean():.3f} on {len(scored)} images (chance 0.1)")
per_digit = pd.Series((scored.prediction == scored.label).to_numpy(), index=scored.label).groupby(level=0).mean()
print("per digit:", per_digit.round(2).to_dict())

fig, axes = plt.subplots(2, 8, figsize=(8, 2.8))
for ax, row in zip(axes.ravel(), scored.head(16).itertuples(), strict=False):
    ax.imshow(PILImage.open(io.BytesIO(row.content)), cmap="gray")
    ax.set_title(f"{row.prediction} ({row.label})", fontsize=9, color="green" if row.prediction == row.label else "red")
    ax.axis("off")
fig.suptitle("predicted (true)", fontsize=9)
show(fig)
"""

IMAGES_SAVE_LOAD = """\
from spark_hvd.data.decode import decode_images
from spark_hvd.estimators import TorchModel

path = os.path.join(workdir, "model")
model.write().overwrite().save(path)
reloaded = TorchModel.load(path)                         # the decoder is saved with the model
again = np.stack(reloaded.transform(test_images).select("label__output").toPandas()["label__output"])
print("reloaded model predicts the same:", np.allclose(np.stack(scored.label__output), again, rtol=1e-5, atol=1e-6))
with torch.no_grad():                                    # transform == the module on the decoded tensors
    direct = reloaded.getModel()(torch.from_numpy(decode_images(list(scored.content), (16, 16), "L", [0.5], [0.5])))
print("transform equals the model on the decoded images:",
      np.allclose(np.stack(scored.label__output), direct.numpy(), rtol=1e-4, atol=1e-5))
"""


def images_notebook() -> nbformat.NotebookNode:
    cells = [
        new_markdown_cell(
            "# Images from files: TorchEstimator on a `binaryFile` DataFrame\n\n"
            "Write scikit-learn's bundled digits as PNG files, read them with "
            "`spark.read.format(\"binaryFile\")` (a `content` column of encoded bytes), and train a small CNN "
            "with **two training processes** that decode, resize and normalise the images on their own reader "
            "pools (`spark_hvd.data.decode.ImageDecoder` as `transformation_fn`); then score held-out raw images "
            "with `transform` (the same decoder, saved with the model), draw them with their predictions, save "
            "and reload. Runs offline in a few minutes; [docs/data.md](../docs/data.md) covers every column kind."),
        new_code_cell(SETUP),
        new_markdown_cell("## A local Spark"),
        new_code_cell(SPARK),
        new_markdown_cell("## PNG files -> a `binaryFile` DataFrame\nThe label is the folder's name; every "
                          "fifth file is held out."),
        new_code_cell(IMAGES_WRITE),
        new_markdown_cell("## Fit: the bytes are decoded on the ranks\nNothing is decoded on the driver: the "
                          "prepared Parquet holds the PNG bytes (row groups sized by bytes), and each rank's reader "
                          "runs the decoder on each batch of them while it trains."),
        new_code_cell(IMAGES_ESTIMATOR),
        new_markdown_cell("## Predictions on held-out raw images"),
        new_code_cell(IMAGES_PREDICT),
        new_markdown_cell("## Save, reload, and check `transform` against the model itself"),
        new_code_cell(IMAGES_SAVE_LOAD),
        new_code_cell(STOP),
    ]
    return _notebook(cells)


def _notebook(cells: list) -> nbformat.NotebookNode:
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


NOTEBOOKS = {
    "torch_estimator.ipynb": torch_notebook,
    "keras_estimator.ipynb": keras_notebook,
    "horovod_api.ipynb": horovod_notebook,
    "image_classifier.ipynb": images_notebook,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--execute", action="store_true", help="run each notebook and keep its outputs")
    parser.add_argument("names", nargs="*", help="only these notebooks (default: all)")
    args = parser.parse_args(argv)
    for name, build in NOTEBOOKS.items():
        if args.names and name not in args.names:
            continue
        nb = build()
        if args.execute:
            from nbclient import NotebookClient

            NotebookClient(nb, timeout=900, kernel_name="python3",
                           resources={"metadata": {"path": str(HERE)}}).execute()
        nbformat.write(nb, HERE / name)
        print("wrote", HERE / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
