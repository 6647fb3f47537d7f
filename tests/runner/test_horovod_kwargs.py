"""Horovod's ``run()`` / ``run_elastic()`` keywords: taken with Horovod's meaning or refused naming the replacement
(``spark_hvd.runner.horovod_kwargs``), checked before any Spark job; the streams' format is Horovod's."""

from __future__ import annotations

import io

import pytest

from spark_hvd.runner import RunnerError, run, run_elastic
from spark_hvd.runner.horovod_kwargs import OutputStreams, horovod_env, np_alias


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"use_mpi": True}, "starts no mpirun on Spark.*leave use_mpi out"),
    ({"use_mpi": False, "use_gloo": False}, "one controller must be used"),
    ({"extra_mpi_args": "-x FOO"}, "no mpirun on Spark.*SPARK_HVD_FUSION_THRESHOLD"),
    ({"executable": "/usr/bin/python3"}, "PYSPARK_PYTHON"),
    ({"nics": []}, "give the network interface names"),
])
def test_run_refuses_what_means_nothing_on_spark_before_any_job(kwargs, match):
    with pytest.raises(RunnerError, match=match):
        run(lambda: None, num_proc=1, **kwargs)  # no session is needed: refused before one is looked up


def test_the_accepted_keywords_keep_env_or_set_the_interfaces():
    env = {"A": "1"}
    assert horovod_env(env, use_gloo=True, use_mpi=False) is env
    assert horovod_env(None) is None
    assert horovod_env(env, nics={"eth1", "eth0"}) == {"A": "1", "SPARK_HVD_NETWORK_INTERFACE": "eth0,eth1"}
    assert horovod_env(None, nics="ib0") == {"SPARK_HVD_NETWORK_INTERFACE": "ib0"}
    assert env == {"A": "1"}  # not changed in place
    with pytest.raises(RunnerError, match="disagree"):
        horovod_env({"SPARK_HVD_NETWORK_INTERFACE": "eth0"}, nics=["eth1"])


def test_min_np_and_max_np_are_the_deprecated_names():
    assert np_alias(None, 2, "min_num_proc", "min_np") == 2
    assert np_alias(3, None, "min_num_proc", "min_np") == 3
    assert np_alias(2, 2, "min_num_proc", "min_np") == 2
    with pytest.raises(RunnerError, match="min_num_proc=3 and min_np=2"):
        run_elastic(lambda: None, num_proc=3, min_num_proc=3, min_np=2)


def test_output_lines_in_horovods_format():
    out, err = io.StringIO(), io.StringIO()
    streams = OutputStreams(out, err)
    assert streams.write(1, "stdout", "a\nb\n") and streams.write(0, "stderr", "c")
    assert out.getvalue() == "[1]<stdout>:a\n[1]<stdout>:b\n" and err.getvalue() == "[0]<stderr>:c\n"
    assert not OutputStreams(out).write(0, "stderr", "x")  # no stream given for stderr: the driver's, by verbose
    assert OutputStreams().lines(2, "stdout", "x\n", horovod=False) == "[2] x\n"
    stamped = OutputStreams(timestamp=True).lines(0, "stdout", "x", horovod=True)
    assert stamped.endswith("[0]<stdout>:x\n") and len(stamped) > len("[0]<stdout>:x\n") + 20
