"""``RayExecutor`` across two Ray nodes (``ray.cluster_utils.Cluster``: two raylets on this machine, loopback only):
ranks numbered node by node with the topology checked (local and cross ranks and sizes), collectives against
numpy between the nodes (different Ray nodes are different hosts for the ring: TCP, not shared memory); and an
elastic job that loses a node mid-training, goes on with the other node's worker from the last commit, and grows
back when a node is added again."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time

import numpy as np
import pytest
from helpers.ray_start import add_node, start_ray

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS = 16
REMOVE_AT = 5  # the second node is removed after this step's commit
ADD_AT = 10  # a node is added again after this step's commit


@pytest.fixture(scope="module")
def nodes(request):
    """``(ray, cluster)``: a head node and one more node, 2 CPUs each, the driver connected to the head."""
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'spark_hvd[ray]')")
    from ray import cloudpickle
    from ray.cluster_utils import Cluster

    cloudpickle.register_pickle_by_value(sys.modules[request.module.__name__])
    if ray.is_initialized():
        ray.shutdown()
    temp_dir = tempfile.mkdtemp(prefix="shvd-ray-")
    saved_tmpdir = os.environ.get("RAY_TMPDIR")
    clusters = []

    def start(attempt_dir: str) -> None:
        os.environ["RAY_TMPDIR"] = attempt_dir  # where Cluster writes the address file, not /tmp/ray
        os.makedirs(os.path.join(attempt_dir, "ray"))
        args = {"num_cpus": 2, "object_store_memory": 80 * 1024**2, "node_ip_address": "127.0.0.1",
                "temp_dir": os.path.join(attempt_dir, "ray")}
        cluster = Cluster()
        clusters.append(cluster)
        cluster.add_node(include_dashboard=False, **args)  # the first node added is the head
        cluster.add_node(**args)
        cluster.wait_for_nodes(timeout=120)
        cluster.spark_hvd_node_args = args
        ray.init(address=cluster.address, configure_logging=False)

    def stop() -> None:
        ray.shutdown()
        if clusters:
            clusters.pop().shutdown()

    try:
        start_ray(start, stop, temp_dir)
        cluster = clusters[0]
        yield ray, cluster
    finally:
        ray.shutdown()
        for cluster in clusters:
            cluster.shutdown()
        if saved_tmpdir is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved_tmpdir
        shutil.rmtree(temp_dir, ignore_errors=True)


def _topology() -> dict:
    import spark_hvd.core as core
    from spark_hvd.core.jobenv import JobEnv
    from spark_hvd.runner import report

    job = JobEnv.from_env()
    ring = core.get_engine().backend
    report(rank=core.rank(), encrypt=job.encrypt)  # over the (encrypted) connection to the driver service
    rng = np.random.default_rng(100 + core.rank())
    x = rng.standard_normal(1000).astype(np.float32)
    rows = rng.standard_normal((1 + core.rank(), 3))
    return {"core": (core.rank(), core.size(), core.local_rank(), core.local_size(), core.cross_rank(),
                     core.cross_size()),
            "job": (job.rank, job.local_rank, job.local_size, job.cross_rank, job.cross_size),
            "group": (os.environ["GROUP_RANK"], os.environ["GROUP_WORLD_SIZE"]),
            "host": os.environ["SPARK_HVD_HOST_ID"],
            "encrypt": (job.encrypt, os.environ["SPARK_HVD_ENCRYPT"], ring.encrypt),
            "peers": (sorted(ring.peers), sorted(j for j, peer in ring.peers.items() if peer.encrypt)),
            "sum": core.allreduce(x, op=core.Sum, name="x"), "gather": core.allgather(rows, name="rows")}


def test_ranks_node_by_node_and_collectives_across_nodes_encrypted(nodes):
    """Also encryption in transit (issue 43): ``SPARK_HVD_ENCRYPT=1`` in ``extra_env_vars`` reaches every rank's
    launch contract, the driver's KV and report services and every ring connection; the collectives across the
    nodes (TCP) agree with numpy and rank 0's report arrives through the encrypted service."""
    from spark_hvd.ray import RayExecutor

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_hosts=2, num_workers_per_host=2)
    seen = []
    try:
        executor.start(extra_env_vars={"SPARK_HVD_ENCRYPT": "1"})
        assert executor.encrypt and executor._kv.encrypt and executor._service.encrypt
        got = executor.run(_topology, callbacks=[seen.append])
        placed = executor.nodes
    finally:
        executor.shutdown()
    assert seen == [{"rank": 0, "encrypt": True}]
    for rank, g in enumerate(got):  # every rank's TCP peers (the other node's ranks among them) encrypt
        peers, encrypted = g["peers"]
        assert g["encrypt"] == (True, "1", True)
        assert peers == encrypted and ({2, 3} if rank < 2 else {0, 1}) <= set(peers)
    assert len({n.node_id for n in placed}) == 2
    assert placed[0].node_id == placed[1].node_id != placed[2].node_id == placed[3].node_id
    for rank, g in enumerate(got):
        local, cross = rank % 2, rank // 2
        assert g["core"] == (rank, 4, local, 2, cross, 2)
        assert g["job"] == (rank, local, 2, cross, 2)
        assert g["group"] == (str(cross), "2")
    assert got[0]["host"] == got[1]["host"] != got[2]["host"] == got[3]["host"]
    xs = [np.random.default_rng(100 + r).standard_normal(1000).astype(np.float32) for r in range(4)]
    rows = [np.random.default_rng(100 + r) for r in range(4)]
    for r, rng in enumerate(rows):
        rng.standard_normal(1000).astype(np.float32)
        rows[r] = rng.standard_normal((1 + r, 3))
    for g in got:
        np.testing.assert_allclose(g["sum"], sum(xs), rtol=1e-5, atol=1e-6)  # float32, another order
        np.testing.assert_array_equal(g["gather"], np.concatenate(rows))


def _wait_for(path: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_tune_checkpoint_of_another_node_is_copied_here(nodes, tmp_path):
    """``NodeCheckpoint.local`` (a Tune trial and its rank 0 on different Ray nodes): a checkpoint made on the other
    node is packed there by a task and unpacked here, removed after; one of this node is used where it is."""
    ray, _ = nodes
    tune = pytest.importorskip("ray.tune")
    from spark_hvd.ray.checkpoints import NodeCheckpoint, node_id

    made = tmp_path / "made"
    (made / "sub").mkdir(parents=True)
    (made / "weights.bin").write_bytes(bytes(range(256)) * 40)
    (made / "sub" / "meta.json").write_text('{"step": 3}')
    here = node_id()
    other = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here)
    checkpoint = tune.Checkpoint.from_directory(str(made))
    with NodeCheckpoint(checkpoint, here).local() as same:
        assert same is checkpoint
    with NodeCheckpoint(checkpoint, other).local() as copy:
        assert copy.path != str(made)
        assert open(os.path.join(copy.path, "weights.bin"), "rb").read() == bytes(range(256)) * 40
        assert open(os.path.join(copy.path, "sub", "meta.json")).read() == '{"step": 3}'
        copied = copy.path
    assert not os.path.exists(copied)


def _elastic_nodes(marks: str, wait_s: float = 60.0) -> dict:
    """The elastic job of this test and of ``tests/multihost/test_ray_hosts.py``: rank 0 logs each step's size and
    time to ``marks/steps.log``; the job asks for a node's removal (``remove``) and addition (``add``) and waits up
    to ``wait_s`` for the test to answer (``removed``, ``added``)."""
    import socket

    import spark_hvd.core as core
    from spark_hvd.core.elastic import ObjectState, run_fn

    state = ObjectState(step=0, sizes=[])

    @run_fn
    def train(state: ObjectState) -> dict:
        while state.step < STEPS:
            core.allreduce(np.ones(8), name="step")
            if core.rank() == 0:
                with open(os.path.join(marks, "steps.log"), "a") as f:
                    f.write(f"{state.step} {core.size()} {time.time()}\n")
            state.sizes = state.sizes + [core.size()]
            state.step += 1
            state.commit()
            if state.step == REMOVE_AT and core.size() == 2:
                if core.rank() == 0:
                    open(os.path.join(marks, "remove"), "w").close()
                _wait_for(os.path.join(marks, "removed"), wait_s)  # the rank on the removed node dies meanwhile
            if state.step == ADD_AT and core.size() == 1:
                open(os.path.join(marks, "add"), "w").close()
                _wait_for(os.path.join(marks, "added"), wait_s)  # the next commit sees the new node's CPUs
            time.sleep(0.05)
        return {"sizes": list(state.sizes), "attempt": int(os.environ["SPARK_HVD_RUN_ATTEMPT"]),
                "node": os.environ["SPARK_HVD_HOST_ID"], "hostname": socket.gethostname()}

    return train(state)


def test_elastic_job_loses_a_node_and_grows_back_when_one_is_added(nodes, tmp_path):
    from spark_hvd.ray import RayExecutor

    ray, cluster = nodes
    marks = str(tmp_path)
    node = next(iter(cluster.worker_nodes))
    # one worker per node: 2 CPUs a worker, so a node holds one
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), min_workers=1, max_workers=2,
                           cpus_per_worker=2, elastic_timeout=60, cooldown_range=[2, 10], reset_limit=3)
    outcome: dict = {}

    def job() -> None:
        try:
            outcome["results"] = executor.run(_elastic_nodes, args=[marks])
        except BaseException as exc:  # noqa: BLE001 - re-raised below, on the test's thread
            outcome["error"] = exc

    deadline = time.monotonic() + 60  # the previous test's placement group given back: both nodes free
    while ray.available_resources().get("CPU", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    executor.start()
    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    try:  # what a failure, then an autoscaler, does to the cluster when the job asks (Ray nodes start and stop
        # from the main thread only)
        _wait_for(os.path.join(marks, "remove"), 120)
        cluster.remove_node(node)
        open(os.path.join(marks, "removed"), "w").close()
        _wait_for(os.path.join(marks, "add"), 120)
        add_node(cluster, **cluster.spark_hvd_node_args)
        deadline = time.monotonic() + 60
        while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        open(os.path.join(marks, "added"), "w").close()
        thread.join(120)
    finally:
        executor.shutdown()
    assert not thread.is_alive()
    if "error" in outcome:
        raise outcome["error"]
    results = outcome["results"]
    sizes = [2] * REMOVE_AT + [1] * (ADD_AT + 1 - REMOVE_AT) + [2] * (STEPS - ADD_AT - 1)
    assert [r["sizes"] for r in results] == [sizes, sizes]
    assert [r["attempt"] for r in results] == [2, 2]
    assert results[0]["node"] != results[1]["node"]
