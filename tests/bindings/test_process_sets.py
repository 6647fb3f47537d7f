"""Horovod process sets in spark_hvd.torch (and spark_hvd.keras, lighter) at N=3 (spark-hvd-run): set {0, 2}
runs every collective (values against numpy, gradients against Horovod's backward definitions) while rank 1 does
nothing or works in its own set {1}; registration, duplicates, removal, ``init(process_sets=)``, errors for
non-members and roots outside the set, and ``DistributedOptimizer(process_set=)`` against a single-process step.
One launch per binding runs every check."""

from __future__ import annotations

import pytest
from helpers.launch import assert_check, launch_worker

pytest.importorskip("torch")

KERAS_CHECKS = ["collectives", "optimizer"]

CHECKS = [
    "registration",
    "allreduce",
    "allgather_broadcast_alltoall_reducescatter",
    "non_member_errors",
    "gradients",
    "optimizer",
    "remove_and_init_process_sets",
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch_worker("psets_worker.py", 3, tmp_path_factory.mktemp("psets"))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", CHECKS)
def test_process_sets(ranks, name):
    assert_check(ranks, name)


@pytest.fixture(scope="module")
def keras_ranks(tmp_path_factory):
    pytest.importorskip("tensorflow")
    pytest.importorskip("keras")
    return launch_worker("kpsets_worker.py", 3, tmp_path_factory.mktemp("kpsets"))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", KERAS_CHECKS)
def test_keras_process_sets(keras_ranks, name):
    assert_check(keras_ranks, name)


def test_process_set_object_before_registration():
    """A ProcessSet sorts its ranks, rejects non-integers and duplicates, and reports None until registered."""
    from spark_hvd.torch import ProcessSet, global_process_set, remove_process_set

    ps = ProcessSet([2, 0])
    assert ps.ranks == [0, 2] and ps.process_set_id is None
    assert ps.size() is None and ps.rank() is None
    assert remove_process_set(ps) is False
    assert global_process_set.process_set_id == 0
    for bad in ([0, "1"], [1, 1], [True]):
        with pytest.raises(ValueError, match="ProcessSet"):
            ProcessSet(bad)


def test_process_set_from_mpi_comm_is_a_clear_error():
    """Horovod's ProcessSet(mpi_comm) is a TypeError that says to pass the ranks (checked with mpi4py's COMM_SELF
    when mpi4py is importable, else with an object that has a communicator's methods)."""
    from spark_hvd.torch import ProcessSet

    class FakeComm:
        def Get_group(self):  # noqa: N802 - mpi4py's name
            return None

    comms: list = [FakeComm()]
    try:
        from mpi4py import MPI

        comms.append(MPI.COMM_SELF)
    except Exception:  # noqa: BLE001 - no mpi4py or no MPI library: the fake communicator covers the check
        pass
    for comm in comms:
        with pytest.raises(TypeError, match=r"ProcessSet\(mpi_comm\) is not supported.*ProcessSet\(\[0, 2\]\)"):
            ProcessSet(comm)
    with pytest.raises(TypeError, match="list of integer ranks, got int 3"):
        ProcessSet(3)
