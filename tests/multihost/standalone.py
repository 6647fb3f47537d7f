"""A Spark standalone cluster on simulated hosts, whose worker hosts a test can lose and bring back.

``Standalone(sim, logs, workers=(1, 2, 3))``: the master on host 0 (port 7077), one one-core worker on each named
host, every daemon in a session of its own inside its host (``SimHost.popen``) with no spark_hvd setting in its
environment. ``lose_host(k)`` kills every process of host ``k`` (the worker JVM, the executor JVM it started and
the executor's Python workers: a reclaimed instance); ``start_worker(k)`` starts its worker again (it registers
with the master, which starts an executor on it for the running application). ``Driver`` runs a driver script
inside host 0 and reads its JSON lines on a thread, so every wait for one is bounded.

The simulated hosts' teardown (``SimHosts.close``) kills whatever is left in their namespaces.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import simhosts

REPO = Path(__file__).resolve().parents[2]
#: the master's and workers' JVM flags: short-lived JVMs on 2 cores start with less CPU on C1 alone, one GC thread
JVM_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def spark_home() -> str:
    """Where pyspark's ``bin/spark-class`` is."""
    import pyspark

    return os.path.dirname(pyspark.__file__)


def daemon_env(address: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """A daemon's (or the driver's) environment: this one without any spark_hvd or Horovod setting, on the host's
    address, with this checkout on ``PYTHONPATH`` ("installed")."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARK_HVD_", "HOROVOD_", "PYSPARK_GATEWAY"))}
    env.update(SPARK_LOCAL_IP=address, SPARK_LOCAL_HOSTNAME=address, SPARK_HOME=spark_home(),
               PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable, OMP_NUM_THREADS="1",
               SPARK_DAEMON_MEMORY="256m", PYTHONPATH=str(REPO), SPARK_DAEMON_JAVA_OPTS=JVM_OPTS)
    env.update(extra or {})
    return env


def wait_for_text(path: Path, text: str, proc: subprocess.Popen | None, within_s: float, count: int = 1) -> None:
    """Wait until ``text`` appears ``count`` times in the file ``path`` (``RuntimeError`` with its tail after
    ``within_s``, or at once when ``proc`` exits)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text(errors="replace").count(text) >= count:
            return
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.5)
    raise RuntimeError(f"{path.name}: {text!r} did not appear {count} time(s) within {within_s:.0f}s:\n"
                       f"{path.read_text(errors='replace')[-3000:] if path.exists() else '(no log)'}")


class Standalone:
    """A master on host 0 and a one-core worker on each of ``workers``; see the module docstring."""

    def __init__(self, sim: simhosts.SimHosts, logs: Path, workers: Sequence[int] = (1, 2, 3),
                 start_s: float = 180.0) -> None:
        self.sim, self.logs, self.start_s = sim, logs, start_s
        self.procs: list[subprocess.Popen] = []
        #: each host's TMPDIR (its daemons', so its executors' and their Python workers'; a driver's on host 0):
        #: what spark_hvd leaves in temporary files is found there, apart from other processes of this machine
        self.tmpdirs = {k: logs / f"tmp{k}" for k in range(len(sim.hosts))}
        for path in self.tmpdirs.values():
            path.mkdir(exist_ok=True)
        self.workers: dict[int, subprocess.Popen] = {}
        self.starts: dict[int, int] = {}
        h0 = sim.hosts[0]
        self.url = f"spark://{h0.address}:7077"
        master_log = logs / "master.log"
        with open(master_log, "w") as out:
            master = h0.popen([self._spark_class(), "org.apache.spark.deploy.master.Master", "--host", h0.address,
                               "--port", "7077", "--webui-port", "8080"], env=self.env(0),
                              stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(master)
        wait_for_text(master_log, "I have been elected leader", master, start_s)
        for k in workers:
            self.start_worker(k, wait=False)
        for k in workers:
            self.wait_registered(k)

    def env(self, k: int, extra: dict[str, str] | None = None) -> dict[str, str]:
        """``daemon_env`` of host ``k``, with its ``TMPDIR``."""
        return daemon_env(self.sim.hosts[k].address, {"TMPDIR": str(self.tmpdirs[k]), **(extra or {})})

    @staticmethod
    def _spark_class() -> str:
        return os.path.join(spark_home(), "bin", "spark-class")

    def worker_log(self, k: int) -> Path:
        """The log of host ``k``'s worker (every start of it appends)."""
        return self.logs / f"worker{k}.log"

    def start_worker(self, k: int, wait: bool = True) -> None:
        """Start host ``k``'s worker (one core, 1 GiB); with ``wait``, until the master has registered it."""
        host = self.sim.hosts[k]
        with open(self.worker_log(k), "a") as out:
            worker = host.popen([self._spark_class(), "org.apache.spark.deploy.worker.Worker", "--host", host.address,
                                 "--cores", "1", "--memory", "1g", "--webui-port", "8081",
                                 "--work-dir", str(self.logs / f"work{k}"), self.url],
                                env=self.env(k), stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(worker)
        self.workers[k] = worker
        self.starts[k] = self.starts.get(k, 0) + 1
        if wait:
            self.wait_registered(k)

    def wait_registered(self, k: int) -> None:
        """Until host ``k``'s latest worker start has registered with the master."""
        wait_for_text(self.worker_log(k), "Successfully registered with master", self.workers[k], self.start_s,
                      count=self.starts[k])

    def lose_host(self, k: int) -> None:
        """Kill every process of host ``k``: its worker, its executor and the executor's Python workers."""
        simhosts._kill_netns_processes(self.sim.hosts[k].name)

    def executor_pid(self, k: int) -> int:
        """The pid of host ``k``'s executor JVM (``CoarseGrainedExecutorBackend``)."""
        for pid in host_pids(self.sim.hosts[k]):
            if "CoarseGrainedExecutorBackend" in _cmdline(pid):
                return pid
        raise AssertionError(f"host {k} runs no executor")

    def close(self) -> None:
        """Kill the daemons' process groups and reap them (the hosts' teardown kills the rest)."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, 9)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass


def host_pids(host: simhosts.SimHost) -> list[int]:
    """Every process of a simulated host (its network namespace)."""
    out = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True, timeout=30).stdout
    return [int(p) for p in out.split()]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def job_processes(host: simhosts.SimHost, job_suffix: str) -> list[str]:
    """The processes of a host started for a spark_hvd job whose id ends with ``job_suffix`` (``a0``: a run's
    first attempt), by the job id they inherited (``SPARK_HVD_JOB_ID`` in ``/proc/PID/environ``): ``pid cmdline``."""
    found = []
    for pid in host_pids(host):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        job = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"SPARK_HVD_JOB_ID=")), None)
        if job is not None and job.endswith(job_suffix):
            found.append(f"{pid} {_cmdline(pid)[:200]}")
    return found


class Driver:
    """A driver script run inside host 0 (``python SCRIPT ARGS...``; ``cluster`` None: on this machine, on
    127.0.0.1, for a ``local-cluster`` master): its stderr in ``log``, its JSON stdout lines read on a thread."""

    def __init__(self, cluster: Standalone | None, script: str, args: Sequence[str], log: Path,
                 env: dict[str, str] | None = None) -> None:
        self.log = log
        with open(log, "w") as err:
            if cluster is None:
                self.proc = subprocess.Popen([sys.executable, script, *args], stdin=subprocess.DEVNULL,
                                             env={**os.environ, "SIM_DRIVER_ADDRESS": "127.0.0.1", **(env or {})},
                                             stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
            else:
                h0 = cluster.sim.hosts[0]
                full_env = cluster.env(0, {"SIM_DRIVER_ADDRESS": h0.address, **(env or {})})
                self.proc = h0.popen([sys.executable, script, *args], env=full_env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=err, text=True)
        self.rows: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.rows.put(json.loads(line))
        self.rows.put(None)

    def row(self, within_s: float) -> dict:
        """The driver's next JSON line (an ``AssertionError`` with the log's tail when none comes)."""
        try:
            row = self.rows.get(timeout=within_s)
        except queue.Empty:
            row = None
        assert row is not None, f"the driver printed no row within {within_s:.0f}s:\n{self.log.read_text()[-6000:]}"
        return row

    def close(self) -> None:
        """Wait for the driver to exit (it stops its SparkContext after its last row); kill it past 60 s."""
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
