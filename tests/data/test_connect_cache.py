"""The prepared-data cache across Spark Connect sessions: two sessions reading the same Parquet files share one
prepared dataset (the key is the Connect plan made session-independent, with the files' sizes and times:
``fingerprint._connect_key``); files rewritten in place give a new key; a source the key cannot cover (SQL text)
stays scoped to its session."""

from __future__ import annotations

import pytest

from spark_hvd.data import prepare_data
from spark_hvd.data.fingerprint import plan_key
from spark_hvd.data.prepare import dataset_key
from spark_hvd.store import Store

pytestmark = [pytest.mark.spark, pytest.mark.slow]


@pytest.fixture
def second_connect(spark, spark_connect):
    """Another Spark Connect session on the same server (what a second notebook, or a restarted one, gets)."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    port = spark.sparkContext.getConf().get("spark.connect.grpc.binding.port")
    previous = getattr(ConnectSession._active_session, "session", None)
    session = ConnectSession.builder.remote(f"sc://127.0.0.1:{port}").create()
    ConnectSession._active_session.session = previous  # private: the thread's active session stays what it was
    assert session.session_id != spark_connect.session_id
    yield session
    session.stop()


def _write(spark, path: str, rows: int) -> None:
    spark.range(rows).selectExpr("id", "cast(id as double) * 0.5 as x").write.mode("overwrite").parquet(path)


def test_two_connect_sessions_share_the_prepared_data(spark, connect_mode, second_connect, tmp_path):
    spark_connect = connect_mode  # functions build Connect columns, as in a Databricks notebook
    data, store = str(tmp_path / "data"), Store.create(str(tmp_path / "store"))
    _write(spark, data, 64)

    def frame(session):
        return session.read.parquet(data).filter("id >= 4")

    first = prepare_data(frame(spark_connect), store, "x", "id", num_proc=2, partitions_per_process=1)
    again = prepare_data(frame(second_connect), store, "x", "id", num_proc=2, partitions_per_process=1)
    assert again == first and store.list_datasets() == [first.key]  # the second session hit the cache
    assert first.train_rows == 60

    _write(spark, data, 32)  # the same path rewritten: a new key, never the stale dataset
    assert dataset_key(frame(second_connect), ["x"], ["id"], num_proc=2) != first.key

    sql = plan_key(spark_connect.sql("SELECT 1 AS x"))
    assert sql["session"] == spark_connect.session_id  # SQL text can read anything: scoped to its session
