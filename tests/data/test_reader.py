"""The sharded batch reader on Parquet files written by pyarrow (no Spark needed)."""

from __future__ import annotations

import collections
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.parquet import write_dataset

from spark_hvd.data.errors import InvalidParamError, ReaderError, TooFewRowsError
from spark_hvd.data.reader import BatchReader, Piece, assign_pieces


def epoch_ids(reader, epoch):
    return [b["id"] for b in reader.epoch(epoch)]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(("n_rows", "size", "batch_size"), [(1003, 1, 32), (1003, 3, 32), (997, 4, 10), (50, 7, 3)])
def test_shards_disjoint_cover_all_equal_steps(tmp_path, shuffle, n_rows, size, batch_size):
    path = write_dataset(tmp_path / "d", n_rows, row_group_size=37)
    readers = [
        BatchReader(path, rank=r, size=size, batch_size=batch_size, shuffle=shuffle, seed=3, shuffle_buffer_rows=64)
        for r in range(size)
    ]
    for epoch in (0, 1):
        shard_sets = []
        steps = set()
        for rd in readers:
            batches = epoch_ids(rd, epoch)
            steps.add(len(batches))
            assert len(batches) == rd.steps_per_epoch == len(rd)
            ids = np.concatenate(batches)
            assert len(ids) == rd.rows_per_epoch
            # the first shard_rows rows are the shard itself, each row once
            first = ids[: rd.shard_rows]
            assert len(np.unique(first)) == rd.shard_rows
            assert set(ids[rd.shard_rows :]) <= set(first)  # padding repeats rows of the own shard only
            shard_sets.append(set(first.tolist()))
        assert len(steps) == 1, f"step counts differ across ranks: {steps}"
        union = set().union(*shard_sets)
        assert union == set(range(n_rows))
        assert sum(len(s) for s in shard_sets) == n_rows  # disjoint


def test_batches_shaped_by_metadata_and_values_consistent(tmp_path):
    path = write_dataset(tmp_path / "d", 300, width=6)
    rd = BatchReader(path, batch_size=25, shapes={"v": (2, 3)}, shuffle=True, seed=1)
    for batch in rd.epoch(0):
        assert batch["v"].shape == (25, 2, 3) and batch["v"].dtype == np.float32
        assert batch["flag"].dtype == np.bool_ and batch["x"].dtype == np.float64
        np.testing.assert_array_equal(batch["v"].reshape(25, 6)[:, 0], batch["id"].astype(np.float32))
        np.testing.assert_array_equal(batch["flag"], batch["id"] % 2 == 0)
    plain = BatchReader(path, batch_size=25, shuffle=False, columns=["id", "v"])
    first = next(iter(plain.epoch(0)))
    assert sorted(first) == ["id", "v"] and first["v"].shape == (25, 6)
    np.testing.assert_array_equal(first["id"], np.arange(25))


def test_shuffle_differs_by_epoch_and_repeats_by_seed(tmp_path):
    path = write_dataset(tmp_path / "d", 2000, row_group_size=100)

    def order(seed, epoch):
        rd = BatchReader(path, batch_size=50, shuffle=True, seed=seed, shuffle_buffer_rows=500)
        return np.concatenate(epoch_ids(rd, epoch))

    e0, e1 = order(7, 0), order(7, 1)
    assert sorted(e0) == sorted(e1) == list(range(2000))
    assert not np.array_equal(e0, e1)
    np.testing.assert_array_equal(e0, order(7, 0))
    np.testing.assert_array_equal(e1, order(7, 1))
    assert not np.array_equal(e0, order(8, 0))
    # rows are mixed across row groups, not only row groups reordered
    first_batch = e0[:50]
    assert len(np.unique(first_batch // 100)) > 1


def test_sequential_without_shuffle(tmp_path):
    path = write_dataset(tmp_path / "d", 200, n_files=2, row_group_size=30)
    rd = BatchReader(path, batch_size=16, shuffle=False)
    ids = np.concatenate(epoch_ids(rd, 0))
    np.testing.assert_array_equal(ids, np.arange(200))


def test_drop_last_gives_full_batches(tmp_path):
    path = write_dataset(tmp_path / "d", 103, n_files=1, row_group_size=10)
    steps = set()
    for r in range(3):
        rd = BatchReader(path, rank=r, size=3, batch_size=8, drop_last=True, seed=0)
        batches = list(rd.epoch(0))
        steps.add(len(batches))
        assert all(len(b["id"]) == 8 for b in batches)
    assert len(steps) == 1
    with pytest.raises(TooFewRowsError, match="drop_last"):
        BatchReader(path, rank=0, size=3, batch_size=100, drop_last=True)


def test_fewer_row_groups_than_ranks(tmp_path):
    path = write_dataset(tmp_path / "d", 10, n_files=1, row_group_size=100)
    seen = []
    for r in range(4):
        rd = BatchReader(path, rank=r, size=4, batch_size=2, shuffle=False)
        seen.append(set(np.concatenate(epoch_ids(rd, 0))[: rd.shard_rows].tolist()))
    assert set().union(*seen) == set(range(10)) and sum(map(len, seen)) == 10
    with pytest.raises(TooFewRowsError, match="11 ranks"):
        BatchReader(path, rank=0, size=11)


def test_assign_pieces_balances_rows():
    pieces = [Piece(0, i, 0, n, True) for i, n in enumerate([100, 90, 50, 40, 30, 10, 5])]
    shards = assign_pieces(pieces, 3)
    rows = [sum(p.num_rows for p in s) for s in shards]
    assert sum(rows) == 325 and max(rows) - min(rows) <= 30  # greedy, largest first: within the 3rd-smallest piece
    assert assign_pieces(list(reversed(pieces)), 3) == shards  # independent of listing order


def test_prefetch_matches_inline_and_stops_when_abandoned(tmp_path):
    path = write_dataset(tmp_path / "d", 500, row_group_size=20)
    inline = BatchReader(path, batch_size=16, seed=2, prefetch=0)
    ahead = BatchReader(path, batch_size=16, seed=2, prefetch=3)
    for a, b in zip(inline.epoch(1), ahead.epoch(1), strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    before = threading.active_count()
    it = ahead.epoch(0)
    next(it)
    it.close()  # leaving early stops the read-ahead thread (joined, with a timeout, in close)
    assert threading.active_count() == before


def test_batches_gathered_together_are_those_of_one_at_a_time_each_its_own(tmp_path, monkeypatch):
    """Without transformation_fn, shuffled batches are gathered several at once from the buffer and handed on as
    views: the same batches, rows in the same order, as one at a time, no two sharing memory; a collate_fn on the
    read-ahead thread (which gathers the next batch before handing one on) gets and gives the same ones."""
    import spark_hvd.data.reader as reader_module

    path = write_dataset(tmp_path / "d", 1000, row_group_size=64)  # 1000 = 20 x 48 + 40: a short last batch

    def epoch(**kw):
        return list(BatchReader(path, batch_size=48, seed=3, shuffle_buffer_rows=300, **kw).epoch(2))

    together = epoch(prefetch=0)
    collated = epoch(prefetch=2, collate_fn=lambda b: {**b, "twice": b["id"] * 2})
    monkeypatch.setattr(reader_module, "SLAB_BYTES", 0)
    alone = epoch(prefetch=0)
    assert len(together) == len(alone) == len(collated) == 21 and len(alone[-1]["id"]) == 40
    for a, b, c in zip(alone, together, collated, strict=True):
        assert list(a) == list(b)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
            np.testing.assert_array_equal(a[k], c[k])
        np.testing.assert_array_equal(c["twice"], a["id"] * 2)
    assert any(b["id"].base is not None for b in together)  # some were gathered together
    for b, b2 in zip(together, together[1:], strict=False):
        assert not any(np.shares_memory(b[k], b2[k]) for k in b)


def test_iter_runs_successive_epochs(tmp_path):
    path = write_dataset(tmp_path / "d", 120)
    rd = BatchReader(path, batch_size=40, seed=5)
    a, b = (np.concatenate([x["id"] for x in rd]) for _ in range(2))
    np.testing.assert_array_equal(a, np.concatenate(epoch_ids(rd, 0)))
    np.testing.assert_array_equal(b, np.concatenate(epoch_ids(rd, 1)))


def test_transformation_fn(tmp_path):
    path = write_dataset(tmp_path / "d", 100, width=3)

    def fn(df):
        df = df.copy()
        df["y"] = df["x"] * 2
        df["v"] = df["v"].map(lambda a: a * 10)
        return df

    rd = BatchReader(path, batch_size=10, shuffle=True, transformation_fn=fn)
    batch = next(iter(rd.epoch(0)))
    np.testing.assert_allclose(batch["y"], batch["x"] * 2)
    assert batch["v"].shape == (10, 3)
    np.testing.assert_allclose(batch["v"][:, 0], batch["id"] * 10)


def test_errors_name_rank_and_column(tmp_path):
    path = write_dataset(tmp_path / "d", 100)
    with pytest.raises(InvalidParamError, match="rank"):
        BatchReader(path, rank=2, size=2)
    with pytest.raises(ReaderError, match="nope"):
        BatchReader(path, columns=["id", "nope"])

    def bad(df):
        raise RuntimeError("user code broke")

    rd = BatchReader(path, rank=1, size=2, transformation_fn=bad)
    with pytest.raises(ReaderError, match="rank 1.*user code broke"):
        list(rd.epoch(0))
    ragged = tmp_path / "ragged"
    ragged.mkdir()
    pq.write_table(pa.table({"v": pa.array([[1.0, 2.0], [3.0]])}), str(ragged / "p.parquet"))
    with pytest.raises(ReaderError, match="'v' holds lists of lengths 1..2"):
        list(BatchReader(str(ragged), batch_size=2, prefetch=0).epoch(0))


@pytest.mark.parametrize("pool", ["jemalloc", "mimalloc", "system", "default"])
def test_memory_pools(tmp_path, pool):
    path = write_dataset(tmp_path / "d", 100)
    counts = collections.Counter()
    for b in BatchReader(path, batch_size=30, memory_pool=pool).epoch(0):
        counts.update(b["id"].tolist())
    assert sorted(counts) == list(range(100))


def test_default_shuffle_buffer_is_bounded_by_the_bytes_of_stored_rows(tmp_path, monkeypatch):
    """Without shuffle_buffer_rows the buffer holds at most DEFAULT_SHUFFLE_BYTES of rows as stored (transformation_fn
    runs per batch, after the shuffle: an encoded image counts at its encoded size): a batch draws on a few row
    groups, not the shard; with the bound lifted it draws on many. Every epoch still yields each row once, and
    transformation_fn sees each batch's rows once."""
    from spark_hvd.data import reader as reader_mod

    path = str(tmp_path / "x.parquet")
    pq.write_table(pa.table({"id": np.arange(400), "blob": [bytes(4096)] * 400}), path, row_group_size=10)
    seen = []

    def decode(df):  # what the function sees: batches of rows as stored
        seen.append(len(df))
        return df.assign(pixels=[np.frombuffer(b, np.uint8)[:4] for b in df["blob"]]).drop(columns="blob")

    def groups_in_first_batch() -> int:
        seen.clear()
        reader = BatchReader(path, batch_size=8, transformation_fn=decode, seed=3)
        batches = list(reader.epoch(0))
        ids = [b["id"] for b in batches]
        assert sorted(np.concatenate(ids).tolist()) == list(range(400))
        assert all(b["pixels"].shape == (8, 4) for b in batches) and seen == [8] * 50
        return len(set((ids[0] // 10).tolist()))

    monkeypatch.setattr(reader_mod, "DEFAULT_SHUFFLE_BYTES", 16 * 4096)  # 16 rows
    assert groups_in_first_batch() <= 3
    monkeypatch.setattr(reader_mod, "DEFAULT_SHUFFLE_BYTES", 1 << 30)  # the whole shard
    assert groups_in_first_batch() >= 5


def test_transformation_fn_may_change_its_frame_in_place(tmp_path):
    """The frame transformation_fn gets owns its columns (writable), shuffled or not, as to_pandas's does."""
    path = str(tmp_path / "x.parquet")
    pq.write_table(pa.table({"id": np.arange(30), "blob": [b"ab"] * 30}), path, row_group_size=8)

    def double(df):
        df["id"] *= 2
        df.loc[0, "blob"] = b"changed"
        return df

    for shuffle in (False, True):
        batches = list(BatchReader(path, batch_size=7, shuffle=shuffle, transformation_fn=double, prefetch=0,
                                   read_ahead_pieces=1).epoch(0))
        ids = np.concatenate([b["id"] for b in batches])
        assert sorted(ids.tolist()) == list(range(0, 60, 2)), shuffle
        assert all(b["blob"][0] == b"changed" and set(b["blob"][1:]) <= {b"ab"} for b in batches)
