"""TorchEstimator's own bad inputs fail with a clear error before any Spark job runs, the store untouched (what every
estimator shares is in test_params.py)."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers.estimators import assert_fit_fails_before_anything_runs

from spark_hvd.estimators import TorchEstimator
from spark_hvd.store import Store

pytestmark = pytest.mark.spark


class _Unpicklable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)
        self.lock = threading.Lock()

    def forward(self, x):
        return self.lin(x)


@pytest.fixture(scope="module")
def df(spark):
    from pyspark.ml.linalg import Vectors

    return spark.createDataFrame([(Vectors.dense([float(i), 1.0]), float(i), float(i % 2), i) for i in range(8)],
                                 ["features", "label", "weight", "cls"])


def _kwargs(store, **kw):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 1))
    args = dict(num_proc=2, store=store, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), loss="mse",
                feature_cols=["features"], label_cols=["label"], batch_size=4, epochs=1, verbose=0)
    args.update(kw)
    return args


CASES = [
    ("misspelt validation column", dict(validation="is_val"), ValueError, r"validation: column 'is_val'"),
    ("two losses, one label", dict(loss=["mse", "l1"]), ValueError, r"2 losses for 1 label columns"),
    ("unknown loss name", dict(loss="hinge"), ValueError, r"unknown loss name 'hinge'"),
    ("no loss", dict(loss=None), ValueError, r"set loss"),
    ("loss weights", dict(loss_weights=[1.0, 2.0]), ValueError, r"loss_weights has 2 entries for 1"),
    ("unpicklable model", dict(model=_Unpicklable()), TypeError, r"_Unpicklable\) cannot be pickled"),
    ("not a module", dict(model="resnet"), TypeError, r"torch.nn.Module"),
    ("zero epochs", dict(epochs=0), ValueError, r"epochs must be a positive integer"),
    ("foreign optimizer", dict(optimizer="adam"), TypeError, r"torch.optim.Optimizer"),
    ("loss class", dict(loss=torch.nn.CrossEntropyLoss), TypeError,
     r"TorchEstimator: loss is the class torch.nn.CrossEntropyLoss, not a loss; pass an instance: "
     r"torch.nn.CrossEntropyLoss\(\)"),
    ("optimizer class", dict(optimizer=torch.optim.Adam), TypeError,
     r"TorchEstimator: optimizer is the class torch.optim.Adam, not an optimizer; build it: "
     r"optimizer=torch.optim.Adam\(model.parameters\(\), lr=1e-3\)"),
    ("model class", dict(model=torch.nn.Linear), TypeError,
     r"model is the class torch.nn.Linear, not a model; pass an instance: model=torch.nn.Linear\(...\)"),
]


@pytest.mark.parametrize("what,kwargs,exc,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_fails_before_anything_runs(spark, df, tmp_path, what, kwargs, exc, match):
    root = tmp_path / "store"
    store = None if kwargs.get("store", 1) is None else Store.create(str(root))
    kwargs = {k: v for k, v in kwargs.items() if k != "store"}
    if kwargs.get("optimizer") == "adam":
        est = TorchEstimator(**_kwargs(store))
        est.setOptimizer("adam")
    else:
        est = TorchEstimator(**_kwargs(store, **kwargs))
    assert_fit_fails_before_anything_runs(spark, est, df, root, what, exc, match)


def test_non_int_params_are_rejected_when_set():
    with pytest.raises(TypeError):
        TorchEstimator(batch_size="big")
    with pytest.raises(ValueError, match="validation fraction"):
        TorchEstimator(validation=1.5)


def test_estimator_params_spark_style():
    est = TorchEstimator(batch_size=16)
    assert est.getBatchSize() == 16 and est.getEpochs() == 1 and est.getShuffle() is True
    assert est.setEpochs(3) is est and est.getEpochs() == 3
    est.setFeatureCols("f")
    assert est.getFeatureCols() == ["f"]
    text = est.explainParams()
    for name in ("num_proc", "loss_weights", "backward_passes_per_step", "mlflow", "input_shapes", "store"):
        assert name in text
    copy = est.copy({est.batch_size: 64})
    assert copy.getBatchSize() == 64 and est.getBatchSize() == 16


PREFLIGHT = [
    ("too few logits", dict(model_out=5, loss="cross_entropy", label_cols=["cls"]),
     r"TorchEstimator: label 'cls' holds class indices up to 7 \(8 classes\) but the model gives 5 values per row; "
     r"a class-index loss needs one logit per class: make the last layer 8 wide"),
    ("regression loss, class outputs", dict(model_out=3, loss="mse"),
     r"TorchEstimator: label 'label' has 1 value\(s\) per row but the model gives 3; .*loss='cross_entropy'"),
    ("bad input width", dict(model_in=3, loss="mse"),
     r"TorchEstimator: the model failed on a forward pass of 4 prepared rows on the driver "
     r"\(inputs: features \(4, 2\)\): RuntimeError"),
]


@pytest.mark.parametrize("what,kw,match", PREFLIGHT, ids=[c[0] for c in PREFLIGHT])
def test_forward_pass_preflight_fails_before_any_rank(spark, df, tmp_path, monkeypatch, what, kw, match):
    """One forward pass on a few prepared rows on the driver checks outputs against labels; no rank starts."""
    from spark_hvd.runner.backend import SparkBackend

    def no_rank(*a, **k):
        raise AssertionError("a training rank started")

    monkeypatch.setattr(SparkBackend, "run", no_rank)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(kw.pop("model_in", 2), kw.pop("model_out", 1)))
    est = TorchEstimator(**_kwargs(Store.create(str(tmp_path / "store")), model=net,
                                   optimizer=torch.optim.SGD(net.parameters(), lr=0.1), **kw))
    with pytest.raises(ValueError, match=match):
        est.fit(df)


def test_horovod_habits_and_keyword_signature():
    """Horovod's input_shapes with the batch dimension are taken; Horovod-only params get a pointer; help() and
    inspect.signature show every param with its default."""
    import inspect

    assert TorchEstimator(input_shapes=[[-1, 1, 28, 28], [3]]).getInputShapes() == [[1, 28, 28], [3]]
    with pytest.raises(ValueError, match=r"input_shapes: \[1, -1\] has an unknown or non-positive dimension"):
        TorchEstimator(input_shapes=[[1, -1]])
    with pytest.raises(TypeError, match=r"no param 'backend' \(a Horovod param: training always runs as one Spark "
                                        r"barrier stage; set num_proc; see docs/migrating-from-horovod.md\)"):
        TorchEstimator(backend="spark")
    sig = inspect.signature(TorchEstimator)
    assert sig.parameters["batch_size"].default == 32 and sig.parameters["batch_size"].kind.name == "KEYWORD_ONLY"
    assert set(sig.parameters) == {p.name for p in TorchEstimator().params}
    assert inspect.signature(TorchEstimator) is sig  # built once


def test_interrupted_fit_names_the_run_and_its_checkpoint(spark, df, tmp_path, monkeypatch, capsys):
    """Ctrl-C while the ranks train (the runner stops them and re-raises): the KeyboardInterrupt that goes on to
    the caller says in one line the run, its last checkpoint and how to resume, raised from fit() itself (a
    traceback of the caller's frame and fit's, not the runner's)."""
    import traceback

    from spark_hvd.runner.backend import SparkBackend
    from spark_hvd.store.run_dir import RunDir

    store = Store.create(str(tmp_path / "store"))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()

    def interrupted(*a, **k):
        RunDir(store, "run-ctrl-c").write_checkpoint(1, str(ckpt), {"history": {}})  # epochs 1 and 2 were done
        raise KeyboardInterrupt

    monkeypatch.setattr(SparkBackend, "run", interrupted)
    est = TorchEstimator(**_kwargs(store, run_id="run-ctrl-c", verbose=1))
    with pytest.raises(KeyboardInterrupt) as info:
        est.fit(df)
    assert str(info.value) == ("TorchEstimator: interrupted; run 'run-ctrl-c' has a checkpoint after epoch 2; resume "
                               "it with setRunId('run-ctrl-c') (or run_id='run-ctrl-c') and fit again")
    frames = traceback.extract_tb(info.value.__traceback__)
    assert [f.name for f in frames] == ["test_interrupted_fit_names_the_run_and_its_checkpoint", "fit"], frames
    assert info.value.__cause__ is None and info.value.__suppress_context__
    # the phase lines and the start summary (verbose=1); fitting again resumes
    with pytest.raises(KeyboardInterrupt):
        est.fit(df)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[spark_hvd]")]
    assert lines[0] == "[spark_hvd] preparing data for 2 ranks"
    assert lines[1].startswith("[spark_hvd] data ds-") and "8 training + 0 validation rows -> 20 files" in lines[1]
    assert lines[2] == ("[spark_hvd] starting 2 ranks (run run-ctrl-c): batch 4 per rank x 2 ranks = 8 rows per "
                        "optimizer step; learning rate 0.1 as given (not scaled by num_proc; Horovod scaled it)")
    assert "[spark_hvd] resuming run run-ctrl-c after epoch 2 of 1" in lines
