"""``make_converter``: petastorm's converter shape over the prepared-data cache, checked against the DataFrame's
own rows (shards disjoint and complete, values equal, epochs repeated), in the driver and inside ``run()``."""

from __future__ import annotations

import numpy as np
import pytest

from spark_hvd.data.converter import default_shard, make_converter
from spark_hvd.store import Store

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def frame(spark):
    from pyspark.ml.linalg import Vectors

    rows = [(i, float(i) / 7, Vectors.dense([i, -i, 0.5 * i])) for i in range(90)]
    return spark.createDataFrame(rows, ["id", "x", "v"])


@pytest.fixture(scope="module")
def conv(spark, frame, tmp_path_factory):
    """One preparation for the module (each costs a Spark job); the last test deletes it."""
    return make_converter(frame, Store.create(str(tmp_path_factory.mktemp("conv") / "store")), num_proc=2)


def _by_id(batches):
    out = {}
    for b in batches:
        for i, row_id in enumerate(b["id"].tolist()):
            out.setdefault(row_id, []).append((float(b["x"][i]), b["v"][i].tolist()))
    return out


def test_two_shards_cover_the_dataframe_as_torch_tensors(conv):
    assert len(conv) == 90 and conv.owned and conv.file_urls
    seen = {}
    for shard in range(2):
        with conv.make_torch_dataloader(batch_size=8, num_epochs=2, cur_shard=shard, shard_count=2) as loader:
            batches = list(loader)
            assert len(batches) == len(loader)
            assert all(isinstance(t, torch.Tensor) for t in batches[0].values())
            assert batches[0]["x"].dtype == torch.float32 and batches[0]["v"].shape[1:] == (3,)
            rows = _by_id(batches)
            # every row of the shard once per epoch; the smaller shard tops up its epoch with a few rows again
            assert all(len(v) >= 2 for v in rows.values())
            assert not set(rows) & set(seen)
            seen.update(rows)
    assert sorted(seen) == list(range(90))
    for i, copies in seen.items():
        for x, v in copies:
            assert x == pytest.approx(i / 7, rel=1e-6) and v == [i, -i, 0.5 * i]


def test_default_shard_follows_the_launcher(monkeypatch):
    for var in ("SPARK_HVD_RANK", "SPARK_HVD_SIZE", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert default_shard() == (0, 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")  # torchrun / TorchDistributor
    assert default_shard() == (1, 3)
    monkeypatch.setenv("SPARK_HVD_RANK", "0")
    monkeypatch.setenv("SPARK_HVD_SIZE", "2")
    assert default_shard() == (0, 2)


@pytest.mark.slow
def test_a_tf_dataset_gives_the_same_rows(conv):
    pytest.importorskip("tensorflow")
    with conv.make_tf_dataset(batch_size=16, shuffle=False) as dataset:
        batches = [{k: v.numpy() for k, v in b.items()} for b in dataset]
    assert batches[0]["x"].dtype == np.float32
    rows = _by_id(batches)
    assert sorted(rows) == list(range(90)) and rows[5][0][1] == [5, -5, 2.5]


@pytest.mark.slow
def test_inside_run_each_rank_reads_its_own_shard(conv):
    from spark_hvd.runner import run

    def train():
        with conv.make_torch_dataloader(batch_size=10, num_epochs=1) as loader:
            return sorted(i for b in loader for i in b["id"].tolist())

    ids = run(train, num_proc=2, verbose=0)
    assert not set(ids[0]) & set(ids[1])
    assert sorted(set(ids[0]) | set(ids[1])) == list(range(90))


def test_the_cache_is_shared_and_only_the_writer_deletes(frame, conv):
    """(Last in the module: it deletes the module's dataset.)"""
    store = conv.store
    with make_converter(frame, store, num_proc=2) as second:  # same DataFrame, same settings: found, not written
        assert second.info.key == conv.info.key and not second.owned
    assert store.exists(store.data_path(conv.info.key))
    with conv:
        pass
    assert not store.exists(store.data_path(conv.info.key))  # the writer's context manager deleted its files
