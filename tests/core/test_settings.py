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
