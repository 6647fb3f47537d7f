"""The launch contract: JobEnv from/to the environment, the topology function, the GPU and threads policies."""

from __future__ import annotations

import pytest

from spark_hvd.core.jobenv import JobEnv, check_distinct_gpus, env_names, gpu_index, topology, torch_threads

FULL = JobEnv(rank=3, size=4, local_rank=1, local_size=2, cross_rank=1, cross_size=2, job_id="j1a0",
              secret=bytes(range(32)), rendezvous="10.0.0.1:4000", service_address="10.0.0.1:5000", attempt=2,
              gpu="7")


@pytest.mark.parametrize("job", [FULL, JobEnv(rank=0, size=1)], ids=["every-field", "minimal"])
def test_round_trip(job):
    env = job.to_env()
    assert all(isinstance(v, str) for v in env.values()) and set(env) <= set(env_names())
    assert JobEnv.from_env(env) == job


def test_the_variable_names_are_the_public_ones():
    env = FULL.to_env()
    assert env["SPARK_HVD_RANK"] == "3" and env["SPARK_HVD_SIZE"] == "4" and env["SPARK_HVD_GPU"] == "7"
    assert env["SPARK_HVD_SECRET"] == bytes(range(32)).hex() and env["SPARK_HVD_RUN_ATTEMPT"] == "2"
    assert env["SPARK_HVD_DRIVER_SERVICE"] == "10.0.0.1:5000" and env["SPARK_HVD_RENDEZVOUS"] == "10.0.0.1:4000"
    assert "secret" not in repr(FULL) and bytes(range(32)).hex() not in repr(FULL)


def test_not_launched_is_none():
    assert JobEnv.from_env({}) is None
    assert JobEnv.from_env({"SPARK_HVD_GPU": "1", "PATH": "/bin"}) is None


@pytest.mark.parametrize("env, message", [
    ({"SPARK_HVD_RANK": "0"}, "SPARK_HVD_SIZE is not set"),
    ({"SPARK_HVD_SIZE": "2"}, "SPARK_HVD_RANK is not set"),
    ({"SPARK_HVD_RANK": "x", "SPARK_HVD_SIZE": "2"}, "SPARK_HVD_RANK='x' is not an integer"),
    ({"SPARK_HVD_RANK": "0", "SPARK_HVD_SIZE": "2", "SPARK_HVD_LOCAL_SIZE": "two"}, "SPARK_HVD_LOCAL_SIZE"),
    ({"SPARK_HVD_RANK": "2", "SPARK_HVD_SIZE": "2"}, "rank 2 is not in a job of size 2"),
    ({"SPARK_HVD_RANK": "0", "SPARK_HVD_SIZE": "2", "SPARK_HVD_LOCAL_RANK": "1"}, "local rank 1"),
    ({"SPARK_HVD_RANK": "0", "SPARK_HVD_SIZE": "2", "SPARK_HVD_SECRET": "zz"}, "SPARK_HVD_SECRET is not a hex"),
])
def test_bad_variables_are_named(env, message):
    with pytest.raises(ValueError, match=message):
        JobEnv.from_env(env)


def test_frozen_and_typed():
    with pytest.raises(AttributeError):
        FULL.rank = 1  # type: ignore[misc]
    with pytest.raises(TypeError, match="JobEnv.rank must be an int"):
        JobEnv(rank="0", size=1)  # type: ignore[arg-type]


def test_topology():
    hosts = ["h1", "h2", "h1", "h2", "h3"]
    assert [topology(hosts, r) for r in range(5)] == [
        (0, 2, 0, 3), (0, 2, 1, 3), (1, 2, 0, 3), (1, 2, 1, 3), (0, 1, 2, 3)]
    assert topology(["a"], 0) == (0, 1, 0, 1)


def test_gpu_policy_assigned_gpu_wins_and_never_wraps():
    job = JobEnv(rank=1, size=2, local_rank=1, local_size=2, gpu="3")
    assert gpu_index(job, 4) == 3
    with pytest.raises(ValueError, match="rank 1: its GPU 3 is not among the 2 CUDA device"):
        gpu_index(job, 2)
    with pytest.raises(ValueError, match="not a CUDA ordinal"):
        gpu_index(JobEnv(rank=0, size=1, gpu="GPU-abc"), 2)


def test_gpu_policy_falls_back_to_the_local_rank():
    job = JobEnv(rank=5, size=6, local_rank=1, local_size=2)
    assert gpu_index(job, 2) == 1
    assert gpu_index(job, 1) is None  # not assigned: the rank stays on the CPU rather than share GPU 0
    with pytest.raises(ValueError, match="rank 5: its GPU 1"):
        gpu_index(job, 1, required=True)
    assert gpu_index(job, 0) is None
    assert gpu_index(None, 1) == 0


def test_distinct_gpus_per_host():
    check_distinct_gpus(["a", "a", "b"], ["0", "1", "0"])
    check_distinct_gpus(["a", "a"], [None, None])
    with pytest.raises(ValueError, match="ranks 0 and 2 on host a were both given GPU 1"):
        check_distinct_gpus(["a", "b", "a"], ["1", "1", "1"])


def test_torch_threads_share_the_cores():
    assert torch_threads(JobEnv(rank=0, size=4, local_rank=0, local_size=4), cpus=16) == 4
    assert torch_threads(JobEnv(rank=0, size=4, local_rank=0, local_size=4), cpus=2) == 1
    assert torch_threads(None, cpus=8) == 8
