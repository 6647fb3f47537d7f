"""CUDA tensors reduced where they lie, by NCCL (the default for CUDA tensors), against numpy.

Needs CUDA: skipped otherwise, with the reason. One GPU runs a one-rank job (the NCCL group's setup and every
device collective at size 1); two GPUs run a two-rank job, one GPU per rank (``SPARK_HVD_GPU``, as the Spark
runner sets it), with NCCL and, for comparison, with ``SPARK_HVD_DEVICE_BACKEND=none`` (CUDA tensors staged
through host memory and the ring). The same scenarios run on CPU with gloo standing in: ``test_device_path.py``.

Process sets: with two or more GPUs, sets [0, 1] and [1, 2] (two GPUs: [0] and [1]) beside the whole job, each
set's CUDA tensors on an NCCL communicator of its own members (``device_scenarios.process_sets``); with one GPU,
two ranks share it, each in a one-rank set (the whole job reduces no CUDA tensor: NCCL refuses two ranks of one
communicator on one GPU), which still builds each set's independent NCCL group and runs every collective on it.

The named network interface (``SPARK_HVD_NETWORK_INTERFACE``) reaches the device groups: NCCL's own log says which
interface its bootstrap took, and two ranks sharing one GPU run every collective on a gloo device group told the
same interface.
"""

from __future__ import annotations

import re

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


def _nccl_interface_job() -> dict:
    import os

    import torch

    import spark_hvd.core as core
    import spark_hvd.torch as hvd

    hvd.init()
    try:
        before = core.get_engine().stats["device_collectives"]
        t = torch.arange(6, dtype=torch.float32, device="cuda")
        hvd.allreduce_(t, op=hvd.Sum, name="iface")
        torch.cuda.synchronize()
        return {"ifname": os.environ.get("NCCL_SOCKET_IFNAME"), "values": t.cpu().tolist(),
                "device_collectives": core.get_engine().stats["device_collectives"] - before}
    finally:
        hvd.shutdown()


def bootstrap_interfaces(log: str) -> set[str]:
    """The interfaces NCCL's log says its bootstrap network uses ("Bootstrap: Using lo:127.0.0.1<0>")."""
    return set(re.findall(r"Bootstrap\s*:\s*Using\s+\[?\d*\]?([\w.-]+):", log))


def test_bootstrap_interfaces_reads_nccl_lines():
    log = ("h:1:1 [0] NCCL INFO Bootstrap: Using lo:127.0.0.1<0>\n"
           "h:1:1 [0] NCCL INFO Bootstrap : Using eth1:198.18.0.2<0>\nNCCL INFO NET/Socket : Using [0]lo:127.0.0.1<0>")
    assert bootstrap_interfaces(log) == {"lo", "eth1"} and bootstrap_interfaces("no such line") == set()


@needs_cuda
def test_nccl_takes_the_named_interface(tmp_path):
    """``SPARK_HVD_NETWORK_INTERFACE=lo`` becomes ``NCCL_SOCKET_IFNAME`` in the rank, and NCCL's own log (its
    bootstrap network) shows it took that interface; the CUDA tensor went through the NCCL group."""
    env = {"SPARK_HVD_GPU": "0", "SPARK_HVD_NETWORK_INTERFACE": "lo", "NCCL_DEBUG": "INFO",
           "NCCL_DEBUG_SUBSYS": "ALL", "NCCL_DEBUG_FILE": str(tmp_path / "nccl.%p.log"), "SPARK_HVD_TIMEOUT": "60"}
    (report,) = run_ranks(_nccl_interface_job, 1, env=env, timeout=240)
    assert report["ifname"] == "lo" and report["device_collectives"] == 1
    assert report["values"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    log = "".join(p.read_text() for p in tmp_path.glob("nccl.*.log"))
    assert bootstrap_interfaces(log) == {"lo"}, log[-3000:]


@needs_cuda
def test_cuda_collectives_two_ranks_sharing_one_gpu_on_gloo_device_group():
    """Two ranks on GPU 0 with ``SPARK_HVD_DEVICE_BACKEND=gloo`` and the interface named: CUDA tensors go to a
    gloo device group (``GLOO_SOCKET_IFNAME`` from the named interface), every collective against numpy."""
    env = {"SPARK_HVD_GPU": "0", "SPARK_HVD_DEVICE_BACKEND": "gloo", "SPARK_HVD_NETWORK_INTERFACE": "lo",
           "SPARK_HVD_TIMEOUT": "60"}
    for report in run_ranks(_job, 2, env=env, args=(False,), timeout=300):
        assert report["checked"] == 14 and report["device_collectives"] >= 20
