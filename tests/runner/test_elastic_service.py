"""The driver side of run_elastic without Spark: requests to the driver service's handlers (answered on the rank's
authenticated connection), the committed state streamed in chunks and kept on the driver's disk across attempts,
and what ranks may ask."""

from __future__ import annotations

import os

import numpy as np
import pytest

from spark_hvd.core import state_stream
from spark_hvd.core.elastic import STATE_MAX_ENV, download_state, upload_state
from spark_hvd.core.transport.wire import make_secret
from spark_hvd.runner.client import ServiceClient
from spark_hvd.runner.elastic import ElasticDriver, OwnFailures, _ServiceLink, _sizes, is_recoverable
from spark_hvd.runner.errors import RankFailedError, RankFailure, RunnerError
from spark_hvd.runner.service import DriverService


class _NoGrowthSpark:
    """A Connect-like session object: ``ElasticDriver`` never grows there (no free-slot count)."""

    __module__ = "pyspark.sql.connect.session"


def _serve(driver: ElasticDriver, num_proc: int = 2):
    secret = make_secret()
    service = DriverService(secret, num_proc, job_id="el1", verbose=0, bind_host="127.0.0.1",
                            handlers=driver.handlers())
    _, port = service.start()
    clients = [ServiceClient(f"127.0.0.1:{port}", secret, "el1", r) for r in range(num_proc)]
    return service, clients


def test_commits_stream_to_the_driver_and_a_later_attempt_fetches_the_last(monkeypatch):
    monkeypatch.setattr(state_stream, "CHUNK_BYTES", 1 << 16)
    driver = ElasticDriver(_NoGrowthSpark(), max_num_proc=2)
    service, clients = _serve(driver)
    try:
        link0, link1 = (_ServiceLink(c) for c in clients)
        assert link0.committed() is None
        first = {"w": np.arange(50_000, dtype=np.float64)}  # 400 kB: 7 chunks of 64 KiB
        second = {"w": np.arange(50_000, dtype=np.float64)[::-1].copy(), "epoch": 2}
        assert upload_state(link0, first) is False and upload_state(link0, second) is False
        assert driver.commits == 2 and os.listdir(driver._dir) == ["committed"]
        back = download_state(link1)
        assert back.keys() == second.keys() and back["epoch"] == 2
        np.testing.assert_array_equal(back["w"], second["w"])
        with pytest.raises(RunnerError, match="only rank 0 commits the elastic state, not rank 1"):
            link1.put("forged", 0, b"by rank 1")
        # an upload cut off mid-way (its rank lost), then a commit of chunks never sent: the last commit stays
        link0.put("cut", 0, b"x" * 10)
        with pytest.raises(RunnerError, match="out of order"):
            link0.put("cut", 2, b"x")
        with pytest.raises(RunnerError, match="was not uploaded whole"):
            link0.commit("cut", [10, 5])
        monkeypatch.setenv(STATE_MAX_ENV, "4")
        with pytest.raises(RunnerError, match="SPARK_HVD_ELASTIC_STATE_MAX"):
            link0.put("big", 0, b"too large")
        with pytest.raises(RunnerError, match="no handler for request 'nope'"):
            clients[0].request("nope")
        assert link0.hosts_updated() is False
        np.testing.assert_array_equal(download_state(link1)["w"], second["w"])  # refused commits left it in place
        for c in clients:
            c.send_done()
        assert service.wait_finished(30.0) and service.failures == []
    finally:
        for c in clients:
            c.close()
        service.stop()
        driver.close()
    assert not os.path.exists(driver._dir)


def test_sizes_and_which_failures_relaunch():
    class Classic:
        pass

    assert _sizes(Classic(), 4, 2, 8) == (4, 2, 8)
    assert _sizes(Classic(), 4, None, None) == (4, 4, 4)
    assert _sizes(Classic(), 9, 1, 3) == (3, 1, 3)
    with pytest.raises(RunnerError, match="min_num_proc=3 is above max_num_proc=2"):
        _sizes(Classic(), 2, 3, 2)
    with pytest.raises(RunnerError, match="max_num_proc must be a positive integer"):
        _sizes(Classic(), 2, 1, 0)
    lost = RankFailure(1, "lost", "ProcessLost", "died")
    peer = RankFailure(0, "exception", "PeerFailureError", "rank 1 closed", consequence=True)
    bug = RankFailure(0, "exception", "ValueError", "bad column")
    assert is_recoverable(RankFailedError(lost, [lost, peer]))
    assert is_recoverable(RankFailedError(peer, [peer]))
    assert not is_recoverable(RankFailedError(bug, [bug, peer]))


def test_an_exception_of_fn_relaunches_until_spark_s_task_failures_or_reset_limit(caplog):
    def bug(rank: int) -> RankFailedError:
        failure = RankFailure(rank, "exception", "ValueError", f"bad batch on rank {rank}",
                              traceback='  File "train.py", line 7, in loop\n', host="10.0.0.5")
        return RankFailedError(failure, [failure])

    own = OwnFailures(max_failures=3, reset_limit=None, run_id="r1")
    own.count(bug(1), resets=0)
    own.count(bug(0), resets=1)
    own.count(bug(1), resets=2)  # rank 1's second failure of Spark's 3
    assert "rank 1 on host 10.0.0.5 raised ValueError: bad batch on rank 1" in caplog.text
    assert 'File "train.py", line 7, in loop' in caplog.text
    last = bug(1)
    with pytest.raises(RankFailedError) as info:  # the third: Spark would fail the job here
        own.count(last, resets=3)
    assert info.value is last and "Spark's limit of 3 failures of one task is reached" in caplog.text
    limited = OwnFailures(max_failures=4, reset_limit=1, run_id="r2")
    limited.count(bug(0), resets=0)
    with pytest.raises(RankFailedError, match="rank 1 failed: ValueError"):
        limited.count(bug(1), resets=1)
    assert "reset_limit=1 is reached: the run fails" in caplog.text
