"""CUDA tensors reduced where they lie, by NCCL (the default for CUDA tensors), against numpy.

Needs CUDA: skipped otherwise, with the reason. One GPU runs a one-rank job (the NCCL group's setup and every
device collective at size 1); two GPUs run a two-rank job, one GPU per rank (``SPARK_HVD_GPU``, as the Spark
runner sets it), with NCCL and, for comparison, with ``SPARK_HVD_DEVICE_BACKEND=none`` (CUDA tensors staged
through host memory and the ring). The same scenarios run on CPU with gloo standing in: ``test_device_path.py``.

Process sets: with two or more GPUs, sets [0, 1] and [1, 2] (two GPUs: [0] and [1]) beside the whole job, each
set's CUDA tensors on an NCCL communicator of its own members (``device_scenarios.process_sets``); with one GPU,
two ranks share it, each in a one-rank set (the whole job reduces no CUDA tensor: NCCL refuses two ranks of one
communicator on one GPU), which still builds each set's independent NCCL group and runs every collective on it.
"""

from __future__ import annotations

import pytest
from helpers.ranks import run_ranks

torch = pytest.importorskip("torch")

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_cuda = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")
needs_two = pytest.mark.skipif(GPUS < 2, reason=f"needs two CUDA GPUs, one per rank ({GPUS} visible here)")


def _job(full: bool) -> dict:
    import helpers.device_scenarios as ds
    import torch

    import spark_hvd.core as core
    import spark_hvd.torch as hvd

    hvd.init()
    try:
        assert torch.cuda.current_device() == int(core.job_env().gpu or 0)
        report = ds.collectives("cuda")
        ds.host_arrays_keep_the_ring()
        if full:
            report["mixed"] = ds.mixed_devices("cuda")
            report["join"] = ds.join_with_device_tensors("cuda")
        return report
    finally:
        hvd.shutdown()


@needs_cuda
def test_cuda_collectives_one_rank_nccl():
    (report,) = run_ranks(_job, 1, env={"SPARK_HVD_GPU": "0"}, args=(False,), timeout=240)
    assert report["checked"] == 14 and report["device_collectives"] >= 20


def _sets_job(with_global: bool) -> dict:
    import helpers.device_scenarios as ds

    import spark_hvd.torch as hvd

    hvd.init()
    try:
        return ds.process_sets("cuda", with_global=with_global)
    finally:
        hvd.shutdown()


@needs_two
def test_cuda_process_sets_nccl():
    import helpers.device_scenarios as ds

    n = min(GPUS, 3)
    env = lambda rank: {"SPARK_HVD_GPU": str(rank), "SPARK_HVD_TIMEOUT": "60"}  # noqa: E731
    ds.check_process_sets(run_ranks(_sets_job, n, env=env, args=(True,), timeout=300), "cuda")


@needs_cuda
def test_cuda_process_sets_one_gpu_two_one_rank_sets():
    import helpers.device_scenarios as ds

    env = {"SPARK_HVD_GPU": "0", "SPARK_HVD_TIMEOUT": "60"}
    ds.check_process_sets(run_ranks(_sets_job, 2, env=env, args=(False,), timeout=300), "cuda")


@needs_two
@pytest.mark.parametrize("device_backend", ["", "none"], ids=["nccl", "through-host"])
def test_cuda_collectives_two_ranks(device_backend):
    env = lambda rank: {"SPARK_HVD_GPU": str(rank), "SPARK_HVD_DEVICE_BACKEND": device_backend,  # noqa: E731
                        "SPARK_HVD_TIMEOUT": "60"}
    reports = run_ranks(_job, 2, env=env, args=(device_backend == "",), timeout=300)
    for report in reports:
        assert report["checked"] == 14
        if device_backend == "":
            assert report["device_collectives"] >= 20 and report["fused"] >= 1
            assert "'mixed' is on cuda on ranks [0]; on host memory on ranks [1]" in report["mixed"]
        else:
            assert report["device_collectives"] == 0


@needs_cuda
def test_cuda_collectives_two_ranks_sharing_one_gpu_through_host():
    """Two ranks on GPU 0 (NCCL refuses two ranks on one GPU): CUDA tensors staged through host memory and the
    ring, every collective against numpy, and a tensor on the GPU on one rank and in host memory on the other
    named as a mismatch."""
    env = {"SPARK_HVD_GPU": "0", "SPARK_HVD_DEVICE_BACKEND": "none", "SPARK_HVD_TIMEOUT": "60"}
    for report in run_ranks(_job, 2, env=env, args=(False,), timeout=300):
        assert report["checked"] == 14 and report["device_collectives"] == 0
