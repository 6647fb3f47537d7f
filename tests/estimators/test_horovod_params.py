"""Horovod's estimator params (0.28.1's ``horovod/spark/{common,torch,keras,lightning}``): each one either works with
Horovod's meaning or is refused on the driver naming what to use instead, and the migration page lists each.

Most checks are on the rank's data loop called directly (``ShardReaders`` over Parquet written here, no Spark job) or
on the driver; one two-rank torch fit (``inmemory_cache_all``, ``loss_constructors`` with a loss that does not pickle,
``label_shapes``) is compared with the same training replayed in one process."""

from __future__ import annotations

import copy
import dataclasses
import pathlib
import pickle
import sys

import cloudpickle
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers.torch_replay import assert_fit_equals_replay, rank_shards, replay

from spark_hvd.data.parquet import describe_parquet
from spark_hvd.data.reader import BatchReader
from spark_hvd.estimators import KerasEstimator, LightningEstimator, TorchEstimator
from spark_hvd.estimators.common.params import HOROVOD_ONLY
from spark_hvd.estimators.common.rank_data import ShardReaders
from spark_hvd.estimators.common.spec import TrainSpec, built_loss
from spark_hvd.runner import SparkBackend
from spark_hvd.store import Store

cloudpickle.register_pickle_by_value(sys.modules[__name__])

ESTIMATORS = [TorchEstimator, KerasEstimator, LightningEstimator]

#: every param of Horovod 0.28.1's estimators (the Params and the constructors' keywords), by estimator
_COMMON = ["num_proc", "train_reader_num_workers", "val_reader_num_workers", "reader_pool_type", "optimizer", "model",
           "backend", "store", "metrics", "loss", "gradient_compression", "compress_sparse_cols", "loss_weights",
           "sample_weight_col", "feature_cols", "label_cols", "continuous_cols", "categorical_cols", "validation",
           "callbacks", "batch_size", "val_batch_size", "epochs", "train_steps_per_epoch",
           "validation_steps_per_epoch", "random_seed", "shuffle_buffer_size", "shuffle", "verbose",
           "partitions_per_process", "run_id", "transformation_fn", "transformation_edit_fields",
           "transformation_removed_fields", "label_shapes", "inmemory_cache_all", "use_gpu", "mp_start_method",
           "backward_passes_per_step", "tensorflow_dataset_prefetch_buffer_size"]
HOROVOD_PARAMS = {
    TorchEstimator: _COMMON + ["data_module", "input_shapes", "loss_constructors", "train_minibatch_fn"],
    KerasEstimator: _COMMON + ["data_module", "custom_objects", "checkpoint_callback", "backend_env"],
    LightningEstimator: _COMMON + ["data_module", "input_shapes", "loss_constructors", "train_minibatch_fn",
                                   "num_gpus", "logger", "log_every_n_steps", "loader_num_epochs",
                                   "terminate_on_nan", "profiler", "debug_data_loader", "trainer_args",
                                   "train_async_data_loader_queue_size", "val_async_data_loader_queue_size"],
}


@pytest.mark.parametrize("cls", ESTIMATORS, ids=lambda c: c.__name__)
def test_every_horovod_param_works_or_is_refused_with_a_pointer(cls):
    est = cls()
    names = {p.name for p in est.params}
    page = (pathlib.Path(__file__).parents[2] / "docs" / "migrating-from-horovod.md").read_text()
    table = page[page.index("<!-- estimator-params"):page.index("## Environment variables")]
    for name in HOROVOD_PARAMS[cls]:
        assert f"`{name}`" in table, f"docs/migrating-from-horovod.md's param table does not list {name!r}"
        if name in names:
            continue
        assert name in HOROVOD_ONLY, f"{cls.__name__} neither takes nor refuses Horovod's {name!r}"
        with pytest.raises(TypeError, match=rf"no param {name!r} \(a Horovod param: .+; see docs/migrating"):
            cls(**{name: None})


def test_mp_start_method_is_the_ranks_start_method_during_the_fit():
    """Horovod's ``mp_start_method``: taken by every estimator (its accessors too), set in the rank around
    training (``start_method``) and put back after; another name is refused when set."""
    import multiprocessing

    from spark_hvd.estimators.common.rank_run import start_method

    for cls in ESTIMATORS:
        est = cls(mp_start_method="spawn")
        est.setMpStartMethod("forkserver")
        assert est.getMpStartMethod() == "forkserver"
        with pytest.raises(ValueError, match="expected one of"):
            cls(mp_start_method="threads")
    before = multiprocessing.get_start_method(allow_none=True)
    other = "spawn" if before != "spawn" else "forkserver"
    with start_method(other):
        assert multiprocessing.get_start_method() == other
    assert multiprocessing.get_start_method(allow_none=True) == before
    with start_method(None):
        assert multiprocessing.get_start_method(allow_none=True) == before


def test_lightning_num_gpus_is_use_gpu():
    """Horovod's Lightning ``num_gpus`` (GPUs per rank): 1 / 0 are ``use_gpu`` True / False for the fit, more (or a
    ``use_gpu`` meaning the other) is refused naming both; unset, ``use_gpu``'s own default again."""
    est = LightningEstimator(num_gpus=0)
    est._apply_num_gpus()
    assert est.getOrDefault(est.use_gpu) is False
    est.setNumGPUs(1)  # Horovod's spelling
    assert est.getNumGPUs() == est.getNumGpus() == 1
    est._apply_num_gpus()
    assert est.getOrDefault(est.use_gpu) is True
    est.setNumGpus(None)
    est._apply_num_gpus()
    assert est.getOrDefault(est.use_gpu) is None
    with pytest.raises(ValueError, match="num_gpus=2: each rank trains on one device"):
        LightningEstimator(num_gpus=2)._apply_num_gpus()
    with pytest.raises(ValueError, match="num_gpus=1 and use_gpu=False disagree"):
        LightningEstimator(num_gpus=1, use_gpu=False)._apply_num_gpus()


# ------------------------------------------------------------------------------ the rank's data loop, no Spark job
def _write(path: pathlib.Path, rows: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 3)).astype(np.float32)
    table = pa.table({"features": pa.array(list(x), type=pa.list_(pa.float32())),
                      "y": (x @ np.array([1.5, -2.0, 0.5]) + 0.3).astype(np.float64),
                      "y4": pa.array(list(rng.standard_normal((rows, 4)).astype(np.float32)),
                                     type=pa.list_(pa.float32()))})
    path.mkdir(parents=True)
    for part in range(2):  # two files of 4 row groups: pieces to shuffle for two ranks
        half = table.slice(part * rows // 2, rows // 2)
        pq.write_table(half, path / f"part-{part}.parquet", row_group_size=rows // 8)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("hvd_params")
    store = Store.create(str(root / "store"))
    _write(root / "train", 256, 0)
    _write(root / "val", 64, 1)
    info = describe_parquet(store, str(root / "train"), ["features"], ["y", "y4"], None, str(root / "val"), 2)
    return store, info


def _shards(dataset, **options) -> list[ShardReaders]:
    store, info = dataset
    spec = TrainSpec(store=store, run_id="r", dataset=info, model_bytes=b"", feature_cols=("features",),
                     label_cols=("y", "y4"), batch_size=16, val_batch_size=16, random_seed=3, **options)
    return [ShardReaders(spec, rank, 2) for rank in range(2)]


def _epochs(shards: list[ShardReaders], epochs: int) -> list[dict]:
    return [b for e in range(epochs) for s in shards for split in ("train", "val") for b in s.epoch(split, e)]


@pytest.fixture
def loads(monkeypatch):
    """Counts the row groups read from the files (``BatchReader._load``)."""
    count = [0]
    load = BatchReader._load

    def counted(self, piece):
        count[0] += 1
        return load(self, piece)

    monkeypatch.setattr(BatchReader, "_load", counted)
    return count


def test_inmemory_cache_all_reads_the_store_once_and_gives_the_same_batches(dataset, loads):
    plain = _epochs(_shards(dataset), 3)
    plain_loads, loads[0] = loads[0], 0
    cached_shards = _shards(dataset, inmemory_cache_all=True)
    cached = _epochs(cached_shards, 3)
    pieces = sum(len(r.pieces) for s in cached_shards for r in s.readers.values())
    assert loads[0] == pieces and plain_loads == 3 * pieces  # read once, where the plain reader reads every epoch
    assert len(cached) == len(plain) and len(plain) > 3 * 2 * 8
    for got, want in zip(cached, plain, strict=True):  # the same rows, shuffled and batched alike every epoch
        assert got.keys() == want.keys()
        for col in want:
            np.testing.assert_array_equal(got[col], want[col])
    assert not np.array_equal(cached[0]["y"], cached[len(cached) // 3]["y"])  # epochs still shuffle differently


def test_shuffle_buffer_size_and_val_reader_num_workers_reach_the_readers(dataset):
    store, info = dataset
    shards = _shards(dataset, shuffle_buffer_size=16, reader_num_workers=2, val_reader_num_workers=1)
    train, val = shards[1].readers["train"], shards[1].readers["val"]
    assert (train.shuffle_buffer_rows, train.read_ahead_pieces, val.read_ahead_pieces) == (16, 2, 1)
    # the training batches are those of a reader with a 16-row buffer, not those of the default buffer (the shard)
    reader = BatchReader.from_dataset(store, info, "train", columns=["features", "y", "y4"], rank=1, size=2,
                                      batch_size=16, seed=3, shuffle_buffer_rows=16)
    got = [b["y"] for b in shards[1].epoch("train", 0)]
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate([b["y"] for b in reader.epoch(0)]))
    default = [b["y"] for b in _shards(dataset)[1].epoch("train", 0)]
    assert not np.array_equal(np.concatenate(got), np.concatenate(default))
    assert _shards(dataset)[0].readers["val"].read_ahead_pieces == min(4, __import__("os").cpu_count() or 1)


def test_label_shapes_reshape_every_label_batch(dataset):
    from spark_hvd.data.keras_loader import KerasBatchDataset

    shaped = _shards(dataset, label_shapes=((1,), (2, 2)))[0]
    batch = next(iter(shaped.epoch("train", 0)))
    assert batch["y"].shape == (16, 1) and batch["y4"].shape == (16, 2, 2)
    plain_shards = _shards(dataset)[0]
    plain = next(iter(plain_shards.epoch("train", 0)))
    np.testing.assert_array_equal(batch["y4"].reshape(16, 4), plain["y4"])
    # Keras's loader reads the reader itself: ShardReaders.batches hands it the reshaped view
    assert plain_shards.batches("val") is plain_shards.readers["val"]
    x, (y, y4) = KerasBatchDataset(shaped.batches("train"), ["features"], ["y", "y4"])[0]
    assert y.shape == (16, 1) and y4.shape == (16, 2, 2)
    assert len(shaped.batches("train")) == len(shaped.readers["train"])
    np.testing.assert_array_equal(y4, batch["y4"])


def test_label_shapes_are_checked_on_the_driver(dataset):
    from spark_hvd.estimators.common.preflight import checked_label_shapes

    assert TorchEstimator(label_shapes=[[-1, 2, 2], [1]]).getLabelShapes() == [[2, 2], [1]]  # Horovod's form too
    _, info = dataset
    assert checked_label_shapes("TorchEstimator", [[1], [2, 2]], info) == ((1,), (2, 2))
    with pytest.raises(ValueError, match=r"label_shapes: label column 'y4' holds 4 values per row \(shape \[4\]\), "
                                         r"which shape \[3\] does not fit"):
        checked_label_shapes("TorchEstimator", [[1], [3]], info)


# ------------------------------------------------------------------------------ driver: backend, encrypt, losses
class HorovodShapedBackend:
    """What Horovod's ``SparkBackend(num_proc, env, **kwargs)`` keeps."""

    def __init__(self, num_proc, env=None, **kwargs):
        self._num_proc, self._env, self._kwargs = num_proc, env, kwargs

    def num_processes(self):
        return self._num_proc


@pytest.mark.spark
@pytest.mark.parametrize("cls", ESTIMATORS, ids=lambda c: c.__name__)
def test_backend_and_encrypt_reach_the_runner(spark, cls):
    runner = TorchEstimator._backend(cls(encrypt=True), spark)  # the shared runner, without Keras's backend env
    assert isinstance(runner, SparkBackend) and runner.encrypt is True
    assert TorchEstimator._backend(cls(), spark).encrypt is None
    given = SparkBackend(spark, 2, env={"MY_VAR": "1"}, encrypt=True, start_timeout=42)
    runner = TorchEstimator._backend(cls(backend=given, verbose=0), spark)
    assert (runner._requested, runner.env["MY_VAR"], runner.encrypt, runner.start_timeout, runner.verbose) == \
        (2, "1", True, 42, 0)
    runner = TorchEstimator._backend(cls(backend=HorovodShapedBackend(2, {"A": "b"}, start_timeout=7)), spark)
    assert (runner._requested, runner.env["A"], runner.encrypt, runner.start_timeout) == (2, "b", None, 7)
    assert TorchEstimator._backend(cls(backend=given, encrypt=False), spark).encrypt is False  # the param wins
    with pytest.raises(ValueError, match=r"backend and num_proc=2 are both set"):
        TorchEstimator._backend(cls(backend=given, num_proc=2), spark)
    with pytest.raises(TypeError, match=r"backend"):
        cls(backend=object())


@pytest.mark.spark
def test_an_estimator_with_a_runner_saves_without_it(spark, tmp_path):
    est = TorchEstimator(backend=SparkBackend(spark, 2), encrypt=True, inmemory_cache_all=True, batch_size=8)
    est.save(str(tmp_path / "est"))
    loaded = TorchEstimator.load(str(tmp_path / "est"))
    assert loaded.getBackend() is None and loaded.getEncrypt() is True and loaded.getInmemoryCacheAll() is True
    assert loaded.getBatchSize() == 8
    assert loaded.setShufflingBufferSize(64).getShufflingBufferSize() == 64 == loaded.getShuffleBufferSize()
    assert loaded.setInMemoryCacheAll(False).getInMemoryCacheAll() is False  # Horovod's accessor names
    assert loaded.setValReaderNumWorker(2).getValReaderNumWorkers() == 2 == loaded.getValReaderNumWorker()


def test_keras_backend_takes_a_name_or_a_runner(spark):
    est = KerasEstimator(backend=HorovodShapedBackend(2))
    assert est._keras_backend_name() is None and est._runner_backend() is not None
    assert KerasEstimator(backend="torch")._keras_backend_name() == "torch"
    assert KerasEstimator(backend="torch")._runner_backend() is None
    with pytest.raises(TypeError, match=r"backend"):
        TorchEstimator(backend="spark")


class Unpicklable(torch.nn.MSELoss):
    """A loss that cannot travel to the ranks (a handle, a lock, a compiled kernel ...)."""

    def __reduce__(self):
        raise TypeError("this loss does not pickle")


def make_loss():
    return Unpicklable()


def test_loss_constructors_are_checked_and_built_on_the_driver_and_the_ranks():
    with pytest.raises(TypeError):
        pickle.dumps(make_loss())
    assert isinstance(built_loss(None, (make_loss,)), Unpicklable)
    assert [type(x) for x in built_loss(None, (make_loss, torch.nn.L1Loss))] == [Unpicklable, torch.nn.L1Loss]
    assert built_loss("mse", ()) == "mse"
    est = TorchEstimator(loss_constructors=[make_loss])
    assert isinstance(est._loss_value(), Unpicklable)
    with pytest.raises(ValueError, match=r"loss and loss_constructors are both set"):
        TorchEstimator(loss="mse", loss_constructors=[make_loss], label_cols=["y"])._check_loss(1)
    with pytest.raises(TypeError, match=r"loss_constructors must be a non-empty list of zero-argument callables"):
        TorchEstimator(loss_constructors=["mse"])
    import keras

    k = KerasEstimator(loss_constructors=[lambda: keras.losses.MeanSquaredError()])
    k._check_loss(1)
    assert isinstance(k._loss_value(), keras.losses.MeanSquaredError)
    with pytest.raises(ValueError, match=r"loss and loss_constructors are both set"):
        KerasEstimator(loss="mse", loss_constructors=[keras.losses.MeanSquaredError])._check_loss(1)
    assert [f.name for f in dataclasses.fields(__import__("spark_hvd.estimators.keras.spec", fromlist=["x"]).KerasSpec)
            if f.name == "loss_constructors"] == ["loss_constructors"]


# ------------------------------------------------------------------------------ one real fit
@pytest.mark.spark
@pytest.mark.slow
def test_fit_with_cache_loss_constructors_and_label_shapes_equals_the_replay(spark, tmp_path, monkeypatch):
    """A two-rank fit with inmemory_cache_all, an unpicklable loss built on the ranks and label_shapes=[[1]] trains
    as the plain reader's batches replayed in one process with the same loss: the same weights."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 3)).astype(np.float32)
    y = x @ np.array([1.5, -2.0, 0.5]) + 0.3
    df = spark.createDataFrame([(x[i].tolist(), float(y[i])) for i in range(256)], "features array<float>, y double")
    store = Store.create(str(tmp_path / "store"))
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    initial = copy.deepcopy(net)
    est = TorchEstimator(num_proc=2, store=store, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.05),
                         loss_constructors=[make_loss], feature_cols=["features"], label_cols=["y"],
                         label_shapes=[[1]], inmemory_cache_all=True, batch_size=16, epochs=3, random_seed=1,
                         partitions_per_process=2, verbose=0)
    fitted = est.fit(df)
    model = copy.deepcopy(initial)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    shards = rank_shards(store, fitted, seed=1, batch_size=16)  # the plain reader (no cache)

    def loss(m, batch):
        return make_loss()(m(torch.from_numpy(batch["features"])), torch.from_numpy(batch["y"]).float()[:, None])

    losses = replay(shards, model, opt, loss, 3)
    assert_fit_equals_replay(fitted, model, losses, atol=1e-5, rtol=1e-4)


def _locked_mse_class():
    import threading

    import keras

    class LockedMSE(keras.losses.Loss):
        """A Keras loss holding a lock: it cannot be pickled (only its class can), so it is built on the ranks.
        Keras saves it in the model's compile config, by its class and ``get_config()``."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.lock = threading.Lock()

        def call(self, y_true, y_pred):
            return keras.ops.mean(keras.ops.square(y_pred - y_true), axis=-1)

        def __reduce__(self):  # Keras 3 pickles a loss by its config; this one refuses, as a lock would
            raise TypeError(f"cannot pickle {type(self).__name__}: it holds {self.lock}")

    return LockedMSE


@pytest.mark.spark
@pytest.mark.slow
def test_keras_fit_with_loss_constructors_label_shapes_and_cache_converges(spark, tmp_path):
    import keras

    locked_mse = _locked_mse_class()
    with pytest.raises(TypeError):
        cloudpickle.dumps(locked_mse())  # the instance; the class itself travels by value
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 3)).astype(np.float32)
    y = x @ np.array([1.5, -2.0, 0.5]) + 0.3
    df = spark.createDataFrame([(x[i].tolist(), float(y[i])) for i in range(256)], "features array<float>, y double")
    model = keras.Sequential([keras.Input(shape=(3,)), keras.layers.Dense(1)])
    est = KerasEstimator(num_proc=2, store=Store.create(str(tmp_path / "store")), model=model,
                         optimizer=keras.optimizers.SGD(learning_rate=0.1), loss_constructors=[locked_mse],
                         custom_objects={"LockedMSE": locked_mse},
                         feature_cols=["features"], label_cols=["y"], label_shapes=[[1]], inmemory_cache_all=True,
                         batch_size=16, epochs=6, random_seed=1, partitions_per_process=2, verbose=0)
    fitted = est.fit(df)
    kernel, bias = fitted.getModel().get_weights()
    np.testing.assert_allclose(kernel.ravel(), [1.5, -2.0, 0.5], atol=0.02)
    np.testing.assert_allclose(bias, [0.3], atol=0.02)
    assert fitted.getHistory()["loss"][-1] < 1e-3 < fitted.getHistory()["loss"][0]
