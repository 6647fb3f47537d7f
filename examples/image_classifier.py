"""An image classifier trained from a folder of PNG files, through ``spark.read.format("binaryFile")``.

What it does, on an embedded local Spark (``local[2]``), with data made offline:

1. writes scikit-learn's bundled digits (1797 handwritten digits) as 32x32 PNG files, ``<digit>/<n>.png``;
2. reads them with ``spark.read.format("binaryFile")`` (a ``content`` column of encoded bytes) and takes the label
   from the folder name;
3. fits a ``TorchEstimator`` whose ``transformation_fn`` is ``spark_hvd.data.decode.ImageDecoder``: the ranks
   decode, resize to 16x16 and normalise the bytes on their reader pool; nothing is decoded on the driver;
4. ``transform``s held-out raw images (the model applies the same decoder), measures accuracy, saves the model,
   loads it back and checks the reloaded one predicts the same.

Run it with ``.venv/bin/python examples/image_classifier.py [--epochs N] [--keep DIR]``; tests/estimators/
test_examples_data.py runs the same functions.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
os.environ.setdefault("OMP_NUM_THREADS", "1")

SIZE = (16, 16)


def write_digit_images(directory: str, pixels: int = 32, image_format: str = "PNG") -> int:
    """sklearn's digits as ``pixels`` x ``pixels`` grey image files ``<directory>/<digit>/<n>.<ext>``; the count."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    ext = "png" if image_format == "PNG" else "jpg"
    for n, (image, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        folder = os.path.join(directory, str(int(label)))
        os.makedirs(folder, exist_ok=True)
        grey = Image.fromarray((image * (255 / 16)).astype(np.uint8), mode="L").resize((pixels, pixels),
                                                                                        Image.BILINEAR)
        grey.save(os.path.join(folder, f"{n:04d}.{ext}"), format=image_format)
    return len(digits.target)


def image_dataframe(spark, directory: str):
    """``binaryFile`` rows (path, content, ...) with ``label`` (int) from the folder name and ``holdout`` (20 %,
    by file number)."""
    from pyspark.sql import functions as F

    df = spark.read.format("binaryFile").option("pathGlobFilter", "*.png").option("recursiveFileLookup", "true") \
        .load(directory)
    number = F.regexp_extract("path", r"/(\d+)\.png$", 1).cast("int")
    return (df.withColumn("label", F.regexp_extract("path", r"/(\d)/[^/]+$", 1).cast("int"))
              .withColumn("holdout", number % 5 == 0)
              .select("path", "content", "label", "holdout")
              .coalesce(4))  # a task per 32 small files is more scheduling than reading


def build_estimator(store, epochs: int = 6, num_proc: int = 2):
    """A small CNN over the decoded 1 x 16 x 16 images; ``ImageDecoder`` as ``transformation_fn``."""
    import torch

    from spark_hvd.data.decode import ImageDecoder
    from spark_hvd.estimators import TorchEstimator

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 10))
    decoder = ImageDecoder("content", size=SIZE, mode="L", mean=[0.5], std=[0.5])
    return TorchEstimator(num_proc=num_proc, store=store, model=net,
                          optimizer=torch.optim.Adam(net.parameters(), lr=3e-3), loss="cross_entropy",
                          metrics=["accuracy"], feature_cols=["content"], label_cols=["label"], batch_size=32,
                          epochs=epochs, random_seed=1, partitions_per_process=2, transformation_fn=decoder,
                          train_reader_num_workers=2, verbose=0)


def accuracy(predictions) -> float:
    """Share of rows whose arg-max logit is the label."""
    import numpy as np

    rows = predictions.select("label", "label__output").collect()
    return float(np.mean([int(np.argmax(r.label__output)) == r.label for r in rows]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--keep", help="a directory to keep the images, store and model in (default: temporary)")
    args = parser.parse_args(argv)
    from pyspark.sql import SparkSession

    from spark_hvd.estimators import TorchModel
    from spark_hvd.store import Store

    work = args.keep or tempfile.mkdtemp(prefix="spark_hvd-images-")
    spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
    print(f"wrote {write_digit_images(os.path.join(work, 'images'))} PNG files", flush=True)
    df = image_dataframe(spark, os.path.join(work, "images"))
    train, test = df.filter("NOT holdout"), df.filter("holdout")
    model = build_estimator(Store.create(os.path.join(work, "store")), args.epochs).fit(train)
    print("history:", {k: [round(v, 3) for v in vs] for k, vs in model.getHistory().items()})
    acc = accuracy(model.transform(test))
    model.write().overwrite().save(os.path.join(work, "model"))
    again = accuracy(TorchModel.load(os.path.join(work, "model")).transform(test))
    print(f"holdout accuracy {acc:.3f} (reloaded model: {again:.3f})")
    spark.stop()


if __name__ == "__main__":
    main()
