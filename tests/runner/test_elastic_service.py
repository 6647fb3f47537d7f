"""The driver side of run_elastic without Spark: requests to the driver service's handlers (answered on the rank's
authenticated connection), the committed state kept across attempts, and what ranks may ask."""

from __future__ import annotations

import pytest

from spark_hvd.core.elastic import STATE_MAX_ENV
from spark_hvd.core.wire import make_secret
from spark_hvd.runner.elastic import _Driver, _recoverable, _ServiceLink, _sizes
from spark_hvd.runner.errors import RankFailedError, RankFailure, RunnerError
from spark_hvd.runner.service import DriverService, ServiceClient


class _NoGrowthSpark:
    """A Connect-like session object: ``_Driver`` never grows there (no free-slot count)."""

    __module__ = "pyspark.sql.connect.session"


def _serve(driver: _Driver, num_proc: int = 2):
    secret = make_secret()
    service = DriverService(secret, num_proc, job_id="el1", verbose=0, bind_host="127.0.0.1",
                            handlers=driver.handlers())
    _, port = service.start()
    clients = [ServiceClient(f"127.0.0.1:{port}", secret, "el1", r) for r in range(num_proc)]
    return service, clients


def test_commits_reach_the_driver_and_a_later_attempt_fetches_the_last(monkeypatch):
    driver = _Driver(_NoGrowthSpark(), max_num_proc=2)
    service, clients = _serve(driver)
    try:
        link0, link1 = (_ServiceLink(c) for c in clients)
        assert link0.committed() is None
        assert link0.commit(b"first") is False and link0.commit(b"second") is False
        assert driver.commits == 2 and link1.committed() == b"second"
        with pytest.raises(RunnerError, match="only rank 0 commits the elastic state, not rank 1"):
            link1.commit(b"forged by rank 1")
        monkeypatch.setenv(STATE_MAX_ENV, "4")
        with pytest.raises(RunnerError, match="SPARK_HVD_ELASTIC_STATE_MAX"):
            link0.commit(b"too large")
        with pytest.raises(RunnerError, match="no handler for request 'nope'"):
            clients[0].request("nope")
        assert link0.hosts_updated() is False
        assert link1.committed() == b"second"  # refused commits left the last good one in place
        for c in clients:
            c.send_done()
        assert service.wait_finished(30.0) and service.failures == []
    finally:
        for c in clients:
            c.close()
        service.stop()


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
    assert _recoverable(RankFailedError(lost, [lost, peer]))
    assert _recoverable(RankFailedError(peer, [peer]))
    assert not _recoverable(RankFailedError(bug, [bug, peer]))
