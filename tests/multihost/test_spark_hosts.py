"""Spark standalone across simulated hosts, with no spark_hvd setting anywhere: a master and a driver on host 0,
one worker (``--cores 1``) on each of hosts 1 and 2, every host's name mapped to 127.0.1.1 in its ``/etc/hosts``
(the Debian trap that once made ranks publish a loopback address). One cluster and one driver process for the
module; ``run()``, ``TorchEstimator`` fit -> transform -> save/load and ``KerasEstimator`` fit -> transform are
checked against numpy / the model called directly, and a ``run()`` told to use the worker hosts' second interface
(eth1) is shown by byte counters to have used it; then host 2's link is taken down mid-run and a rank process is
killed mid-fit (each must fail fast naming the host), and last a worker host's processes are all killed mid-run."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import simhosts

pytestmark = [pytest.mark.spark, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
DRIVER = str(Path(__file__).with_name("spark_driver.py"))
#: the master's and workers' JVM flags (the driver's come from SPARK_SUBMIT_OPTS, set by tests/conftest.py, and the
#: executors' from spark_driver.py): short-lived JVMs on 2 cores start with less CPU on C1 alone, one GC thread
JVM_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def _spark_home() -> str:
    import pyspark

    return os.path.dirname(pyspark.__file__)


def _daemon_env(address: str) -> dict[str, str]:
    """A daemon's environment: this one without any spark_hvd or Horovod setting, on the host's address."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARK_HVD_", "HOROVOD_", "PYSPARK_GATEWAY"))}
    env.update(SPARK_LOCAL_IP=address, SPARK_LOCAL_HOSTNAME=address, SPARK_HOME=_spark_home(),
               PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable, OMP_NUM_THREADS="1",
               SPARK_DAEMON_MEMORY="256m", PYTHONPATH=str(REPO),  # PYTHONPATH: this checkout, "installed"
               SPARK_DAEMON_JAVA_OPTS=JVM_OPTS)
    return env


def _wait_for(path: Path, text: str, proc: subprocess.Popen, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    raise RuntimeError(f"{path.name}: {text!r} did not appear within {within_s:.0f}s:\n"
                       f"{path.read_text(errors='replace')[-3000:] if path.exists() else '(no log)'}")


@pytest.fixture(scope="module")
def cluster(simhosts_ready, tmp_path_factory):
    logs = tmp_path_factory.mktemp("spark-hosts")
    sim = simhosts.SimHosts(3, rate="1gbit")
    procs: list[subprocess.Popen] = []
    try:
        h0 = sim.hosts[0]
        spark_class = os.path.join(_spark_home(), "bin", "spark-class")
        master_log = logs / "master.log"
        with open(master_log, "w") as out:
            master = h0.popen([spark_class, "org.apache.spark.deploy.master.Master", "--host", h0.address,
                               "--port", "7077", "--webui-port", "8080"], env=_daemon_env(h0.address),
                              stdout=out, stderr=subprocess.STDOUT)
        procs.append(master)
        _wait_for(master_log, "I have been elected leader", master, 120)
        url = f"spark://{h0.address}:7077"
        for k in (1, 2):  # a second interface on each worker host, for the ``iface`` step (eth0 stays routed)
            sim.add_interface(k, "eth1")
        for k, h in enumerate(sim.hosts[1:], 1):
            log = logs / f"worker{k}.log"
            with open(log, "w") as out:
                worker = h.popen([spark_class, "org.apache.spark.deploy.worker.Worker", "--host", h.address,
                                  "--cores", "1", "--memory", "1g", "--webui-port", "8081", url],
                                 env=_daemon_env(h.address), stdout=out, stderr=subprocess.STDOUT)
            procs.append(worker)
        for k, worker in enumerate(procs[1:], 1):
            _wait_for(logs / f"worker{k}.log", "Successfully registered with master", worker, 120)
        yield sim, url, logs
    finally:
        sim.close()  # kills every daemon, executor and Python worker in the hosts' namespaces
        for p in procs:
            p.wait(timeout=30)


class ElasticDriver:
    """The module's one driver process (``spark_driver.py`` reading its steps from stdin) and its JSON lines."""

    def __init__(self, cluster) -> None:
        sim, url, logs = cluster
        h0 = sim.hosts[0]
        self.log = logs / "driver.log"
        env = {**_daemon_env(h0.address), "SIM_DRIVER_ADDRESS": h0.address}
        with open(self.log, "w") as err:
            self.proc = h0.popen([sys.executable, DRIVER, url, str(logs / "store")], env=env, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=err, text=True)
        self.rows = _rows(self.proc)

    def send(self, *steps: str) -> None:
        self.proc.stdin.write("".join(f"{step}\n" for step in steps))
        self.proc.stdin.flush()

    def row(self, within_s: float) -> dict:
        return _next_row(self.rows, self.log, within_s)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # end of steps: the driver stops its SparkContext and exits
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def driver(cluster):
    """One driver process (one SparkContext, one executor per worker host) for every step of the module: starting
    a driver and its executors again costs more than most steps."""
    proc = ElasticDriver(cluster)
    try:
        yield proc
    finally:
        proc.close()


@pytest.fixture(scope="module")
def results(driver):
    """The driver's rows of the steps that need no interference from the test, by step."""
    steps = ["run", "torch", "keras", "iface"]
    driver.send(*steps)
    rows = {}
    for _ in steps:
        row = driver.row(600)
        rows[row["step"]] = row
    return rows


def _ok(row: dict) -> dict:
    assert "error" not in row, f"{row['error']}\n{row.get('traceback', '')}"
    return row


def test_run_spans_the_hosts_with_no_configuration(cluster, results):
    sim = cluster[0]
    row = _ok(results["run"])
    ranks = row["ranks"]
    assert sorted(r["hostname"] for r in ranks) == sorted(h.name for h in sim.hosts[1:])
    for r in ranks:
        assert r["allreduce"], r
        assert (r["local_size"], r["cross_size"], r["transport"]) == (1, 2, "tcp")  # never shared memory
        assert r["env"] == []  # no spark_hvd setting reached the ranks
        other = next(h for h in sim.hosts[1:] if h.name != r["hostname"])
        assert r["peers"] == [f" on host {other.name} ({other.address})"]  # the peer's real address, not 127.0.1.1


def test_torch_estimator_fit_transform_save_load(results):
    row = _ok(results["torch"])
    assert row["loss"][-1] < row["loss"][0] / 4, row["loss"]
    assert row["transform_matches_model"] and row["reloaded_equal"]


def test_keras_estimator_fit_transform(results):
    row = _ok(results["keras"])
    assert row["loss"][-1] < row["loss"][0], row["loss"]
    assert row["transform_matches_model"]


def test_named_data_interface_carries_the_traffic_under_spark(cluster, results):
    """Worker hosts with two interfaces and ``SPARK_HVD_NETWORK_INTERFACE=eth1`` given to ``run()``: the ranks
    publish and connect on eth1 (the peer is named by its eth1 address), and the host's byte counters show the
    8 MiB allreduce left by eth1 while eth0 (the route to the driver) carried almost nothing meanwhile."""
    sim = cluster[0]
    ranks = _ok(results["iface"])["ranks"]
    assert len(ranks) == 2
    eth1 = {h.name: h.interfaces["eth1"] for h in sim.hosts[1:]}
    for r in ranks:
        assert r["allreduce"], r
        assert len(r["peers"]) == 1 and any(f"({address})" in r["peers"][0] for address in eth1.values()), r
        sent = r["sent"]
        assert sent["eth1"] > 0.9 * 8 * 1024 * 1024, r  # each rank of the 2-rank ring sends the array once
        assert sent["eth0"] < sent["eth1"] / 10, r


def _rows(proc: subprocess.Popen) -> queue.SimpleQueue:
    """The driver's JSON lines, read on a thread (so a wait for one is bounded)."""
    rows: queue.SimpleQueue = queue.SimpleQueue()

    def pump() -> None:
        for line in proc.stdout:
            if line.startswith("{"):
                rows.put(json.loads(line))
        rows.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return rows


def _next_row(rows: queue.SimpleQueue, log: Path, within_s: float) -> dict:
    try:
        row = rows.get(timeout=within_s)
    except queue.Empty:
        row = None
    assert row is not None, f"the driver printed no row within {within_s:.0f}s:\n{log.read_text()[-4000:]}"
    return row


def _wait_marks(marks: Path, pattern: str, count: int, proc: subprocess.Popen, log: Path,
                within_s: float) -> list[Path]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and proc.poll() is None:
        found = sorted(marks.glob(pattern))
        if len(found) >= count:
            return found
        time.sleep(0.2)
    raise AssertionError(f"{marks}/{pattern}: fewer than {count} within {within_s:.0f}s (driver exit "
                         f"{proc.poll()}):\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def faults(cluster, driver):
    """Two faults in turn on the module's driver: host 2's link taken down mid-``run()`` (brought back once the
    rank on host 1 has failed), then a rank process on host 2 killed mid-``TorchEstimator.fit``. The Spark daemons
    stay up, so the module's other tests do not depend on the order."""
    sim = cluster[0]
    _, survivor, victim = sim.hosts
    proc, log = driver.proc, driver.log
    driver.send("linkdown", "fitkill")
    out: dict = {}
    try:
        marks = Path(driver.row(300)["marks"])
        _wait_marks(marks, "rank-*-running", 2, proc, log, 240)
        time.sleep(1.0)
        victim.link(False)
        down_at = time.monotonic()
        try:
            failed = _wait_marks(marks, f"failed-{survivor.name}", 1, proc, log, 120)
            out["linkdown_detect_s"] = time.monotonic() - down_at
        finally:
            victim.link(True)
        out["linkdown_survivor_error"] = failed[0].read_text()
        out["linkdown"] = driver.row(300)
        marks = Path(driver.row(300)["marks"])
        fitting = _wait_marks(marks, "fitting-*", 2, proc, log, 300)
        time.sleep(1.0)
        pid = int(next(p for p in fitting if p.name == f"fitting-{victim.name}").read_text())
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        out["fitkill"] = driver.row(300)
        out["fitkill_s"] = time.monotonic() - killed_at
    finally:
        victim.link(True)
    print(json.dumps(out, indent=1))  # shown with a failing test
    return out


def test_link_down_mid_run_fails_fast_naming_the_host(cluster, faults):
    """Under Spark, a host whose link goes down mid-allreduce: the rank left behind fails within SPARK_HVD_TIMEOUT
    (8 s) naming the lost rank and its host, and ``run()`` raises with it."""
    victim = cluster[0].hosts[2]
    where = f"on host {victim.name} ({victim.address})"
    assert re.search(rf"rank [01] {re.escape(where)} sent nothing for 8s", faults["linkdown_survivor_error"]), \
        faults["linkdown_survivor_error"]
    assert faults["linkdown_detect_s"] < 8 + 40, faults["linkdown_detect_s"]  # the timeout, plus a loaded machine
    row = faults["linkdown"]
    assert row["outcome"] == "failed", row
    assert where in row["error"], row["error"]


def test_rank_killed_mid_fit_fails_fast_naming_its_host(cluster, faults):
    """A rank's process killed mid-``TorchEstimator.fit``: the fit fails naming the lost rank's host (the lost
    process by its address, the surviving rank's error by host name and address), with nothing hanging."""
    victim = cluster[0].hosts[2]
    row = faults["fitkill"]
    assert row["outcome"] == "failed", row
    assert f"process on host {victim.address} died" in row["error"], row["error"]
    assert f"on host {victim.name} ({victim.address})" in row["error"], row["error"]
    assert faults["fitkill_s"] < 120, faults["fitkill_s"]


def test_worker_host_killed_mid_run_fails_naming_it(cluster, driver, results, faults):
    """Runs last, on the module's driver (it leaves host 2 without a worker; ``results`` and ``faults`` are asked
    for so that their steps, which need both hosts, come first also when this test is run alone)."""
    sim = cluster[0]
    victim = sim.hosts[2]
    driver.send("kill")
    marks = Path(driver.row(300)["marks"])
    _wait_marks(marks, "rank-*-running", 2, driver.proc, driver.log, 240)
    time.sleep(1.0)
    killed_at = time.monotonic()
    simhosts._kill_netns_processes(victim.name)  # the worker, its executor and the rank's Python process
    row = driver.row(300)
    took = time.monotonic() - killed_at
    assert row["outcome"] == "failed", row
    # the surviving rank names the lost one and its host; Spark's own report may come first
    assert f"on host {victim.name} ({victim.address})" in row["error"] or "lost" in row["error"], row
    assert took < 120, (took, row)
