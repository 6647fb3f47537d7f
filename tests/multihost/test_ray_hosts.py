"""``RayExecutor`` on a Ray cluster of simulated hosts: ``ray start --head`` on host 0 (no CPUs: the driver's
node), ``ray start --address=...`` on hosts 1 and 2 (2 CPUs each), each inside its host's network and UTS
namespaces (``simhosts``, 1 Gbit/s links, addresses in 198.18.0.0/15), token authentication on, an 80 MB object
store per node. The driver runs on host 0 (this file as a script, ``driver`` below), since ``RayExecutor``'s
driver must be on a node of the cluster.

* The topology: 2 hosts x 2 workers, ranks node by node, local and cross ranks and sizes, every rank's host its
  simulated host (its own host name and address), an allreduce and an allgather against numpy.
* A lost host: an elastic job (one 2-CPU worker per host, ``min_workers=1``) loses host 2 mid-training (every
  process of its namespace killed: raylet, object store, the worker), goes on with host 1's worker from the last
  commit, and grows back to 2 when host 2's Ray node is started again. ``recovery_s`` (the kill to the first step
  trained again) is printed, not asserted.

Cost: ~2-3 minutes on 2 loaded cores (three Ray nodes start in ~30 s each, one restarts), so it is marked
``raycluster`` and runs with ``make ray-clusters``, not in ``make test``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import simhosts  # beside this file (conftest puts the folder on the path; a script has it as sys.path[0])

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.raycluster]

RAY_PORT = 6380
NODE_ARGS = ["--object-store-memory=80000000", "--disable-usage-stats"]


def _ray_cli() -> str:
    return str(Path(sys.executable).with_name("ray"))


def _env(token: str) -> dict[str, str]:
    """The environment of every Ray process (nodes, driver; the workers inherit their raylet's)."""
    root = str(Path(__file__).resolve().parents[2])
    return dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token,
                PYTHONPATH=root, OMP_NUM_THREADS="1",
                # the head notices a lost node in ~2 s, not ~15 s
                RAY_health_check_period_ms="500", RAY_health_check_failure_threshold="3",
                RAY_health_check_initial_delay_ms="1000")


class RayHosts:
    """Ray nodes on simulated hosts (``start_node``), and drivers run on host 0 (``drive``)."""

    def __init__(self, sim, logs: Path) -> None:
        self.sim = sim
        self.logs = logs
        self.env = _env(secrets.token_hex(32))
        self.head = sim.hosts[0]
        self.address = f"{self.head.address}:{RAY_PORT}"
        self._start(0, ["--head", f"--port={RAY_PORT}", "--num-cpus=0", "--include-dashboard=false",
                        f"--temp-dir={sim.tmp}/ray"])
        for k in (1, 2):  # one at a time: Ray gives a node 30 s to register, which a loaded machine can exceed
            self.start_node(k)

    def _start(self, k: int, args: list[str], tries: int = 2) -> None:
        """``ray start`` on host ``k`` (every process of the host killed and tried again once if it fails)."""
        host = self.sim.hosts[k]
        for _ in range(tries):
            done = host.run([_ray_cli(), "start", f"--node-ip-address={host.address}", *args, *NODE_ARGS],
                            env=self.env, timeout=180)
            with open(self.logs / f"ray-start-h{k}.log", "a") as f:
                f.write(done.stdout + done.stderr)
            if done.returncode == 0:
                return
            simhosts._kill_netns_processes(host.name)
        raise AssertionError(f"ray start on {host.name} failed {tries} times:\n{done.stdout}\n{done.stderr[-3000:]}")

    def start_node(self, k: int) -> None:
        """``ray start --address=<head>`` on host ``k`` (2 CPUs)."""
        self._start(k, [f"--address={self.address}", "--num-cpus=2"])

    def drive(self, mode: str, marks: Path) -> subprocess.Popen:
        """This file as a driver on host 0 (``driver(mode, ...)``), its output in ``marks/driver.log``."""
        log = open(marks / "driver.log", "w")  # noqa: SIM115 - closed with the process
        return self.head.popen([sys.executable, __file__, mode, self.address, str(marks)], env=self.env,
                               stdout=log, stderr=subprocess.STDOUT)

    def result(self, proc: subprocess.Popen, marks: Path, timeout_s: float = 400) -> dict:
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = None
        log = (marks / "driver.log").read_text()
        assert rc == 0, f"the driver on host 0 exited {rc}:\n{log[-6000:]}"
        return json.loads((marks / "result.json").read_text())


@pytest.fixture(scope="module")
def ray_hosts(simhosts_ready, tmp_path_factory):
    """A Ray cluster on three simulated hosts (see the module docstring)."""
    pytest.importorskip("ray", reason="ray is not installed (pip install 'spark_hvd[ray]')")
    sim = simhosts.SimHosts(3, rate="1gbit")
    try:
        yield RayHosts(sim, tmp_path_factory.mktemp("ray-hosts"))
    finally:
        sim.close()


# -- the ranks' functions (pickled by value: this file is the driver's __main__) ----------------------------------
def _topology() -> dict:
    import socket

    import spark_hvd.core as core

    rng = np.random.default_rng(100 + core.rank())
    x = rng.standard_normal(100_000).astype(np.float32)
    rows = rng.standard_normal((1 + core.rank(), 3))
    return {"core": [core.rank(), core.size(), core.local_rank(), core.local_size(), core.cross_rank(),
                     core.cross_size()],
            "hostname": socket.gethostname(), "iface": os.environ.get("SPARK_HVD_IFACE_ADDR"),
            "host_id": os.environ["SPARK_HVD_HOST_ID"],
            "sum": core.allreduce(x, op=core.Sum, name="x").tolist(),
            "gather": core.allgather(rows, name="rows").tolist()}


def _test_nodes() -> Any:
    """``tests/ray/test_nodes.py``, whose elastic job (``_elastic_nodes``) and step numbers this test shares."""
    if "test_nodes" not in sys.modules:
        spec = importlib.util.spec_from_file_location("test_nodes", Path(__file__).parents[1] / "ray" / "test_nodes.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["test_nodes"] = module
        spec.loader.exec_module(module)
    return sys.modules["test_nodes"]


def _answer_added(marks: str) -> None:
    """On the driver: once the test restarted host 2's node (``restarted``) and Ray counts its CPUs, ``added``."""
    import ray

    deadline = time.monotonic() + 600
    while not os.path.exists(os.path.join(marks, "restarted")) and time.monotonic() < deadline:
        time.sleep(0.1)
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    open(os.path.join(marks, "added"), "w").close()


def driver(mode: str, address: str, marks: str) -> None:
    """Run on host 0: connect to the cluster, run ``mode``'s job, write ``marks/result.json``."""
    import ray
    from ray import cloudpickle

    from spark_hvd.ray import RayExecutor

    ray.init(address=address, configure_logging=False)
    out: dict = {}
    if mode == "topology":
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=120), num_hosts=2, num_workers_per_host=2)
        try:
            executor.start()
            out["ranks"] = executor.run(_topology)
            out["nodes"] = [[n.node_ip, n.node_id, n.hostname] for n in executor.nodes]
        finally:
            executor.shutdown()
    else:
        nodes = _test_nodes()
        cloudpickle.register_pickle_by_value(nodes)
        threading.Thread(target=_answer_added, args=(marks,), daemon=True).start()
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=120, placement_group_timeout_s=30),
                               min_workers=1, max_workers=2, cpus_per_worker=2, elastic_timeout=120,
                               cooldown_range=[4, 10], reset_limit=5)
        executor.start()
        try:
            out["ranks"] = executor.run(nodes._elastic_nodes, args=[marks, 240.0])
        finally:
            executor.shutdown()
    with open(os.path.join(marks, "result.json"), "w") as f:
        json.dump(out, f)
    ray.shutdown()


# -- the tests -----------------------------------------------------------------------------------------------------
def test_topology_and_collectives_across_simulated_hosts(ray_hosts, tmp_path):
    got = ray_hosts.result(ray_hosts.drive("topology", tmp_path), tmp_path)
    ranks = got["ranks"]
    names = {h.name: h.address for h in ray_hosts.sim.hosts[1:]}
    assert len({node_id for _, node_id, _ in got["nodes"]}) == 2
    for rank, g in enumerate(ranks):
        assert g["core"] == [rank, 4, rank % 2, 2, rank // 2, 2]
        assert g["hostname"] in names
        assert g["iface"] == names[g["hostname"]] == got["nodes"][rank][0]  # the ring's address: its host's
        assert got["nodes"][rank][2] == g["hostname"]
    assert ranks[0]["hostname"] == ranks[1]["hostname"] != ranks[2]["hostname"] == ranks[3]["hostname"]
    assert ranks[0]["host_id"] == ranks[1]["host_id"] != ranks[2]["host_id"] == ranks[3]["host_id"]
    xs, rows = [], []
    for r in range(4):
        rng = np.random.default_rng(100 + r)
        xs.append(rng.standard_normal(100_000).astype(np.float32))
        rows.append(rng.standard_normal((1 + r, 3)))
    for g in ranks:
        np.testing.assert_allclose(np.array(g["sum"], dtype=np.float32), sum(xs), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.array(g["gather"]), np.concatenate(rows))


def test_elastic_job_loses_a_host_and_grows_back_when_its_ray_node_returns(ray_hosts, tmp_path):
    victim = ray_hosts.sim.hosts[2]
    proc = ray_hosts.drive("elastic", tmp_path)
    try:
        _wait_host_mark(tmp_path / "remove", proc)
        killed_at = time.time()
        simhosts._kill_netns_processes(victim.name)  # raylet, object store, agents, the worker: a lost host
        (tmp_path / "removed").write_text(str(killed_at))
        _wait_host_mark(tmp_path / "add", proc)
        ray_hosts.start_node(2)
        (tmp_path / "restarted").touch()  # the driver answers "added" once Ray counts the node's CPUs
        got = ray_hosts.result(proc, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
    results = got["ranks"]
    nodes = _test_nodes()
    sizes = [2] * nodes.REMOVE_AT + [1] * (nodes.ADD_AT + 1 - nodes.REMOVE_AT) + [2] * (nodes.STEPS - nodes.ADD_AT - 1)
    assert [r["sizes"] for r in results] == [sizes, sizes]
    assert all(r["attempt"] >= 2 for r in results) and results[0]["attempt"] == results[1]["attempt"]
    assert {r["hostname"] for r in results} == {h.name for h in ray_hosts.sim.hosts[1:]}
    steps = [line.split() for line in (tmp_path / "steps.log").read_text().splitlines()]
    after = [float(t) for _, size, t in steps if int(size) == 1 and float(t) > killed_at]
    print(f"recovery_s={after[0] - killed_at:.1f} (host 2 killed to the first step trained again on 1 worker)")


def _wait_host_mark(path: Path, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the driver exited {proc.returncode} before {path.name}:\n"
                                 f"{(path.parent / 'driver.log').read_text()[-6000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {path.name} mark within {timeout_s:g} s")
        time.sleep(0.1)


if __name__ == "__main__":
    driver(*sys.argv[1:4])
