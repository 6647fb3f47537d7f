"""The device path (CUDA tensors reduced where they lie) on CPU: gloo stands in for NCCL.

``SPARK_HVD_DEVICE_BACKEND=gloo`` sends torch CPU tensors down exactly the code CUDA tensors take (a
``DeviceBuffer`` through the engine's negotiation and per-device fusion, the lazily opened ``TorchDeviceGroup``,
its rendezvous on the job's authenticated KV service, never a TCPStore), so the plumbing is tested on every run.
The same jobs run process sets beside the whole job (``device_scenarios.process_sets``: each set's device tensors
on a group of its own members, every collective interleaved with the other set's and the job's).
The CUDA run of the same scenarios is in ``test_cuda.py``.
"""

from __future__ import annotations

import sys

import cloudpickle
import numpy as np
import pytest
from helpers.ranks import run_ranks

pytest.importorskip("torch")

# the executors' Python workers cannot import this test module: ship its functions by value
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _job(device: str) -> dict:
    import helpers.device_scenarios as ds
    import torch.distributed as dist

    import spark_hvd.torch as hvd

    def no_tcpstore(*args, **kwargs):  # the groups meet through the job's authenticated KV service, not a TCPStore
        raise AssertionError("a torch.distributed.TCPStore was created")

    dist.TCPStore = no_tcpstore
    hvd.init()
    try:
        report = ds.collectives(device)
        ds.host_arrays_keep_the_ring()
        report["mixed"] = ds.mixed_devices(device)
        report["sets"] = ds.process_sets(device)
        report["join"] = ds.join_with_device_tensors(device)
        return report
    finally:
        hvd.shutdown()


@pytest.mark.parametrize("n, host_backend", [(2, "ring"), (3, "torch")], ids=["np2-ring", "np3-torch"])
def test_device_path_with_gloo_standing_in(n, host_backend):
    # host arrays on the ring, or on torch.distributed (SPARK_HVD_BACKEND=torch, which then owns the default
    # group: the device group is a new group beside it)
    env = {"SPARK_HVD_DEVICE_BACKEND": "gloo", "SPARK_HVD_BACKEND": host_backend, "SPARK_HVD_TIMEOUT": "60",
           "SPARK_HVD_CYCLE_TIME": "5"}
    reports = run_ranks(_job, n, env=env, args=("cpu",), timeout=240)
    for report in reports:
        assert report["checked"] == 14
        assert report["fused"] >= 1  # the grouped allreduce went as (at most a few) fused collectives
        assert report["device_collectives"] >= 20
        assert "'mixed' is on cpu on ranks [0]; on host memory on ranks" in report["mixed"]
    # the joined rank contributed zeros on its device; the last to join is one of the others, the same everywhere
    assert len({report["join"] for report in reports}) == 1 and reports[0]["join"] in range(n - 1)
    import helpers.device_scenarios as ds

    ds.check_process_sets([report["sets"] for report in reports], "cpu")


def test_two_ranks_of_a_group_on_one_gpu_are_named():
    # each group rank's (host index, GPU); the names are global ranks (here a set of global ranks 1, 3, 4, 6)
    from spark_hvd.core.engine.device import GroupScope
    from spark_hvd.core.engine.torch_device import _one_gpu_per_rank, shared_gpus
    from spark_hvd.core.errors import SparkHvdError

    assert shared_gpus([(0, 0), (0, 1), (1, 0), (1, 1)], [1, 3, 4, 6]) == []
    assert shared_gpus([(0, 0), (0, 1), (0, 0), (1, 0)], [1, 3, 4, 6]) == [(0, [1, 4])]


    class Gathered:  # the group's backend at set-up: what the allgather of (host index, GPU) returns
        cross_rank = 0

        def allgather(self, mine: np.ndarray) -> np.ndarray:
            return np.array([0, 0, 0, 1, 0, 0], dtype=np.int64)

    with pytest.raises(SparkHvdError, match=r"ranks \[1, 4\] on GPU 0 of one host in process set 2: NCCL needs"):
        _one_gpu_per_rank(Gathered(), GroupScope(2, (1, 3, 4)), 0)


def test_which_tensors_take_the_device_path():
    from spark_hvd.core.engine.device import device_key
    from spark_hvd.core.settings import Settings

    assert [device_key("cuda", b) for b in (None, "nccl", "gloo", "none")] == ["cuda", "cuda", "cuda", None]
    assert [device_key("cpu", b) for b in (None, "nccl", "gloo", "none")] == [None, None, "cpu", None]
    assert Settings.from_env({"SPARK_HVD_DEVICE_BACKEND": " NCCL "}).device_backend == "nccl"
    with pytest.raises(ValueError, match="SPARK_HVD_DEVICE_BACKEND='mpi' is not valid: expected one of nccl"):
        Settings.from_env({"SPARK_HVD_DEVICE_BACKEND": "mpi"})


def _spark_rank() -> dict:
    import torch
    import torch.distributed as dist

    import spark_hvd.torch as hvd

    def no_tcpstore(*args, **kwargs):
        raise AssertionError("a torch.distributed.TCPStore was created")

    saved, dist.TCPStore = dist.TCPStore, no_tcpstore  # the Python worker is reused: put it back after
    try:
        mine = torch.arange(6, dtype=torch.float32) * (hvd.rank() + 1)
        summed = hvd.allreduce(mine, op=hvd.Sum, name="spark.device")
        return {"rank": hvd.rank(), "mine": mine.numpy(), "sum": summed.numpy(),
                "device_group": dist.is_initialized() and dist.get_backend() == "gloo"}
    finally:
        dist.TCPStore = saved


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.parametrize("host_backend", ["ring", "torch"])
def test_device_path_under_the_spark_runner_meets_through_the_driver_service(spark, host_backend):
    # no launcher KV service under Spark: the device group's store (and, with SPARK_HVD_BACKEND=torch, the torch
    # backend's) is the driver service's KV ("kv" hello)
    from spark_hvd.runner import run

    env = {"SPARK_HVD_DEVICE_BACKEND": "gloo", "SPARK_HVD_BACKEND": host_backend}
    results = run(_spark_rank, num_proc=2, env=env, verbose=0)
    assert [r["rank"] for r in results] == [0, 1] and all(r["device_group"] for r in results)
    expected = results[0]["mine"] + results[1]["mine"]
    for r in results:
        np.testing.assert_array_equal(r["sum"], expected)
