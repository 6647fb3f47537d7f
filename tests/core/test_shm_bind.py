"""The shared-memory ranks of a host on CPUs of their own (``spark_hvd.core.transport.shm_bind``)."""

import os
import threading

import pytest

from spark_hvd.core.transport import shm_bind


def test_each_local_rank_gets_an_equal_run_of_the_cpus_and_no_rank_shares_one():
    cpus = [7, 0, 3, 1, 2, 6, 5, 4]
    shares = [shm_bind.share(cpus, r, 3) for r in range(3)]
    assert shares == [[0, 1], [2, 3], [4, 5]]  # sorted, the remainder (6, 7) to no one
    assert shm_bind.share(cpus, 1, 2) == [4, 5, 6, 7]
    assert shm_bind.share([0, 1], 1, 3) == [0, 1]  # fewer CPUs than ranks: every CPU, as unbound
    assert shm_bind.share([0, 1], 0, 1) == [0, 1]


def test_off_by_default_and_one_rank_binds_nothing(monkeypatch):
    monkeypatch.delenv("SPARK_HVD_SHM_BIND", raising=False)
    assert shm_bind.bind(0, 2) is None
    monkeypatch.setenv("SPARK_HVD_SHM_BIND", "0")
    assert shm_bind.bind(0, 2) is None
    monkeypatch.setenv("SPARK_HVD_SHM_BIND", "1")
    assert shm_bind.bind(0, 1) is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and two CPUs")
def test_bind_holds_the_thread_and_the_threads_it_starts_and_restore_frees_them_all(monkeypatch):
    monkeypatch.setenv("SPARK_HVD_SHM_BIND", "1")
    before = os.sched_getaffinity(0)
    seen: dict[str, set[int]] = {}
    release = threading.Event()

    def worker() -> None:
        seen["started"] = os.sched_getaffinity(0)
        release.wait(10)
        seen["after"] = os.sched_getaffinity(0)

    def run() -> None:  # in a thread of its own, so that a failure leaves the test process unbound
        restore = shm_bind.bind(1, 2)
        assert restore is not None
        seen["bound"] = os.sched_getaffinity(0)
        child = threading.Thread(target=worker)
        child.start()
        while "started" not in seen:
            threading.Event().wait(0.001)
        restore()
        seen["restored"] = os.sched_getaffinity(0)
        release.set()
        child.join(10)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(20)
    share = set(shm_bind.share(sorted(before), 1, 2))
    assert seen["bound"] == share and seen["started"] == share
    assert seen["restored"] == before and seen["after"] == before
    assert os.sched_getaffinity(0) == before  # the test's own thread was never bound
