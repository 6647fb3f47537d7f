"""A text classifier trained from a string column, tokenised on the ranks, with variable-length token ids.

The corpus ships offline with the libraries installed here: the docstrings of numpy's and torch's functions; the
task is to tell which library a docstring comes from (two classes, balanced). What it does, on ``local[2]``:

1. collects the docstrings (first 60 words each) into a DataFrame ``text`` (string), ``label`` (0 numpy, 1 torch);
2. trains a BPE tokenizer on the training rows in seconds (the ``tokenizers`` package);
3. fits a ``TorchEstimator`` whose ``collate_fn`` tokenises each batch of strings on the ranks and pads the ids to
   the batch's longest row (``Tokenize``); the model (an embedding averaged over the non-pad ids, then a linear
   layer) takes the padded ids;
4. ``transform``s held-out strings (the model applies the same ``collate_fn``), measures accuracy, saves and
   reloads the model.

Run it with ``.venv/bin/python examples/text_classifier.py [--epochs N]``; tests/estimators/test_examples_data.py
runs the same functions.
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

import cloudpickle  # noqa: E402
import torch  # noqa: E402

# the ranks and transform's Python workers cannot import this file: its classes travel by value
cloudpickle.register_pickle_by_value(sys.modules[__name__])

VOCAB = 2000


def docstrings(per_library: int = 600, words: int = 60) -> list[tuple[str, int]]:
    """``(text, label)`` pairs: docstrings of numpy (0) and torch (1) callables, balanced, shuffled."""
    import random

    import numpy
    import torch

    def collect(modules) -> list[str]:
        seen, out = set(), []
        for module in modules:
            for name in sorted(dir(module)):
                doc = getattr(getattr(module, name, None), "__doc__", None)
                if isinstance(doc, str) and len(doc.split()) >= 8 and doc not in seen:
                    seen.add(doc)
                    out.append(" ".join(doc.split()[:words]))
        return out

    np_docs = collect([numpy, numpy.linalg, numpy.random, numpy.fft, numpy.ma])
    torch_docs = collect([torch, torch.nn, torch.nn.functional, torch.linalg, torch.fft, torch.Tensor])
    n = min(per_library, len(np_docs), len(torch_docs))
    rows = [(t, 0) for t in np_docs[:n]] + [(t, 1) for t in torch_docs[:n]]
    random.Random(0).shuffle(rows)
    return rows


def train_tokenizer(texts: list[str]):
    """A BPE tokenizer with ``[PAD]`` = 0, trained on ``texts`` (a few seconds)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["[PAD]", "[UNK]"]))
    return tok


class Tokenize:
    """``collate_fn``: the batch's strings in ``column`` -> int64 ids padded with 0 to the batch's longest row."""

    def __init__(self, tokenizer, column: str = "text", max_len: int = 128) -> None:
        self.tokenizer, self.column, self.max_len = tokenizer, column, max_len

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        from spark_hvd.data.reader import pad_ragged

        encoded = self.tokenizer.encode_batch([str(t) for t in batch[self.column]])
        rows = np.empty(len(encoded), dtype=object)
        rows[:] = [np.asarray(e.ids[:self.max_len], dtype=np.int64) for e in encoded]
        batch = dict(batch)
        batch[self.column], _ = pad_ragged(rows, 0)
        return batch


def build_estimator(store, tokenizer, epochs: int = 6, num_proc: int = 2):
    """Mean of token embeddings (pad excluded) -> linear, over ids made by ``Tokenize`` in ``collate_fn``."""
    import torch

    from spark_hvd.estimators import TorchEstimator

    torch.manual_seed(0)
    net = MeanEmbedding(tokenizer.get_vocab_size(), 32)
    return TorchEstimator(num_proc=num_proc, store=store, model=net,
                          optimizer=torch.optim.Adam(net.parameters(), lr=1e-2), loss="cross_entropy",
                          metrics=["accuracy"], feature_cols=["text"], label_cols=["label"], batch_size=32,
                          epochs=epochs, random_seed=1, partitions_per_process=2, collate_fn=Tokenize(tokenizer),
                          verbose=0)


class MeanEmbedding(torch.nn.Module):
    """Average of the non-pad ids' embeddings, then a linear layer to 2 logits."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim, padding_idx=0)
        self.out = torch.nn.Linear(dim, 2)

    def forward(self, ids):
        mask = (ids != 0).unsqueeze(-1).float()
        mean = (self.embed(ids) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return self.out(mean)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args(argv)
    import numpy as np
    from pyspark.sql import SparkSession

    from spark_hvd.store import Store

    work = tempfile.mkdtemp(prefix="spark_hvd-text-")
    spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
    rows = docstrings()
    cut = int(len(rows) * 0.8)
    train = spark.createDataFrame(rows[:cut], "text string, label int")
    test = spark.createDataFrame(rows[cut:], "text string, label int")
    tokenizer = train_tokenizer([t for t, _ in rows[:cut]])
    model = build_estimator(Store.create(os.path.join(work, "store")), tokenizer, args.epochs).fit(train)
    out = model.transform(test).select("label", "label__output").collect()
    acc = float(np.mean([int(np.argmax(r.label__output)) == r.label for r in out]))
    print(f"holdout accuracy {acc:.3f} over {len(out)} docstrings")
    spark.stop()


if __name__ == "__main__":
    main()
