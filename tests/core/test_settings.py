from spark_hvd.core.settings import MIB, Settings


def test_defaults():
    s = Settings.from_env({})
    assert s.fusion_threshold == 64 * MIB
    assert s.cycle_time_ms == 1.0
    assert s.timeout_s == 30.0
    assert s.timeline is None


def test_horovod_alias_and_precedence():
    s = Settings.from_env({"HOROVOD_FUSION_THRESHOLD": "1024", "HOROVOD_CYCLE_TIME": "5"})
    assert s.fusion_threshold == 1024 and s.cycle_time_ms == 5.0
    s = Settings.from_env({"HOROVOD_FUSION_THRESHOLD": "1024", "SPARK_HVD_FUSION_THRESHOLD": "2048"})
    assert s.fusion_threshold == 2048


def test_bad_value_names_the_variable():
    import pytest

    with pytest.raises(ValueError, match="HOROVOD_CYCLE_TIME"):
        Settings.from_env({"HOROVOD_CYCLE_TIME": "fast"})


def test_mac_threads_setting_and_auto(monkeypatch):
    import os

    import pytest

    from spark_hvd.core.transport.mac_pool import MAX_AUTO_THREADS, threads_for

    assert Settings.from_env({}).mac_threads == 0  # off by default: tags in the calling thread
    assert Settings.from_env({"SPARK_HVD_MAC_THREADS": "2"}).mac_threads == 2
    assert Settings.from_env({"SPARK_HVD_MAC_THREADS": "auto"}).mac_threads is None
    with pytest.raises(ValueError, match="SPARK_HVD_MAC_THREADS"):
        Settings.from_env({"SPARK_HVD_MAC_THREADS": "-1"})
    assert threads_for(0, 1) == 0 and threads_for(2, 8) == 2
    # auto: the cores this process may use, shared among the host's ranks, one kept for the calling thread
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert threads_for(None, 2) == min(MAX_AUTO_THREADS, 7)
    assert threads_for(None, 8) == 1
    assert threads_for(None, 16) == 0
