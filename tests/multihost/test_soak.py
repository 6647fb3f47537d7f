"""A long elastic fit across simulated hosts under random faults (marker ``soak``; ``make hostloss``).

The module's Spark standalone cluster (three one-core worker hosts), an elastic ``TorchEstimator`` fit at 3 ranks
(``min_num_proc=1``) paced to ~0.3 s a batch, for ``SPARK_HVD_SOAK_S`` seconds (default 600). Every 30-90 s a fault
drawn from a list seeded by ``SPARK_HVD_SOAK_SEED`` (default 1) hits a host running a rank: its rank process
killed, its executor JVM killed (``kill -9``; its worker starts another), its link down for 5-30 s, its link
slowed to 100 Mbit/s for 30 s, or the store made to fail its uploads for 2-5 s (every directory of the store made
immutable, ``chattr +i``: even root creates nothing there; the rank's upload fails and its writer retries after
1, 2 and 4 s). Then the fit is told to stop at the end of its epoch and, while the application
still runs:

* its weights equal a one-process replay of exactly the committed batches at each size;
* no host runs a process that inherited a spark_hvd job id, no Python process holds a TCP socket on the simulated
  network (the ring's and the driver service's connections and listeners), no segment of the run is left in
  ``/dev/shm`` and no ``spark_hvd`` temporary in any host's ``TMPDIR`` (each host's own, so that other processes
  of the machine do not count).

It prints the table: faults by kind, the resets they caused and the growths back after them, recovery time each
(training stopped for: the longest gap between batches around the fault; median, max), steps lost (batches
trained after the last checkpoint and trained again). A store fault during which no upload failed (no retry logged
by a rank) is counted as ``store (no upload during it)``.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from lost_host_driver import attempt_cuts
from standalone import Driver, Standalone, host_pids, job_processes

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.soak]

DRIVER = str(Path(__file__).with_name("lost_host_driver.py"))
SOAK_S = float(os.environ.get("SPARK_HVD_SOAK_S", "600"))
SEED = int(os.environ.get("SPARK_HVD_SOAK_SEED", "1"))
EVERY = 3
KINDS = ("rank", "executor", "linkdown", "slow", "store")


def _log(marks: Path) -> list[tuple[int, int, int, int, float]]:
    path = marks / "batches.log"
    rows = [line.split() for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [(int(a), int(e), int(s), int(n), float(t)) for a, e, s, n, t in rows]


def _spark_hvd_temps(cluster: Standalone, run_id: str) -> list[str]:
    """spark_hvd's temporaries in the hosts' ``TMPDIR`` and the run's shared-memory segments
    (``/dev/shm/spark_hvd-<job id>-...``; the job ids of a run start with its id)."""
    found = [str(p) for d in cluster.tmpdirs.values() for p in d.iterdir() if p.name.startswith("spark_hvd")]
    return found + sorted(os.path.join("/dev/shm", n) for n in os.listdir("/dev/shm")
                          if n.startswith(f"spark_hvd-{run_id}"))


def _shape(cluster: Standalone, k: int, rate: str) -> None:
    """Change the rate of host ``k``'s link, both ways (its ``eth0`` and its bridge port)."""
    host = cluster.sim.hosts[k]
    for ns, dev in ((host.name, "eth0"), (cluster.sim.bridges[0], f"p{k}eth0"[:15])):
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "change", "dev", dev, "root", "tbf", "rate", rate,
                        "burst", "262144", "latency", "50ms"], check=True, capture_output=True, timeout=30)


def _immutable(dirs: list[Path], on: bool) -> None:
    """``chattr +i`` (``on``) or ``-i`` on the directories, in one call (one process per directory took seconds on
    a loaded machine, stretching the outage): nothing can be created, renamed or removed in them."""
    if dirs:
        subprocess.run(["chattr", "+i" if on else "-i", *map(str, dirs)], capture_output=True, timeout=60)


def _upload_retries(cluster: Standalone) -> int:
    """How many failed uploads the ranks have logged (``BackgroundWriter``'s retry warnings in the executors'
    stderr)."""
    return sum(p.read_text(errors="replace").count("failed (try") for k in cluster.tmpdirs
               for p in (cluster.logs / f"work{k}").glob("*/*/stderr"))


def _ranks_now(marks: Path, cluster: Standalone) -> dict[int, tuple[int, int]]:
    """The latest attempt's ranks: rank -> (host index, pid)."""
    latest: dict[int, dict[int, tuple[int, int]]] = {}
    names = {h.name: k for k, h in enumerate(cluster.sim.hosts)}
    for path in marks.glob("rank-*-*"):
        _, attempt, rank = path.name.split("-")
        host, pid = path.read_text().split()
        latest.setdefault(int(attempt), {})[int(rank)] = (names[host], int(pid))
    return latest[max(latest)] if latest else {}


def _python_net_sockets(host) -> list[str]:
    """TCP sockets of Python processes on the simulated network (not loopback) in a host."""
    out = host.run(["ss", "-tanpH"]).stdout.splitlines()
    return [line for line in out if "python" in line and "198.1" in line]


def _python_threads(host) -> dict[int, int]:
    """pid -> threads of each Python process of a host."""
    out = {}
    for pid in host_pids(host):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if "python" in status.split("\n", 1)[0]:
            out[pid] = int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))
    return out


@pytest.mark.timeout(SOAK_S + 900)  # the cluster's start, the soak, the last epoch and the replay
def test_a_long_fit_under_random_faults_recovers_each_and_leaks_nothing(standalone_cluster, tmp_path):
    cluster = standalone_cluster
    rng = random.Random(SEED)
    marks = tmp_path / "marks"
    marks.mkdir()
    cfg = {"elastic": True, "num_proc": 3, "min_num_proc": 1, "max_num_proc": 3, "every": EVERY, "epochs": 100000,
           "executors": 3, "throttle": 0.0, "pace": 0.3, "hold": True, "reset_limit": 100}
    driver = Driver(cluster, DRIVER, [cluster.url, str(tmp_path / "store"), str(marks), json.dumps(cfg)],
                    tmp_path / "driver.log")
    driver.row(300)  # started
    faults: list[dict] = []
    frozen: list[Path] = []
    try:
        deadline = time.monotonic() + SOAK_S
        while True:
            wait = rng.uniform(30, 90)
            if time.monotonic() + wait > deadline:
                break
            time.sleep(wait)
            last = len(_log(marks))
            until = time.monotonic() + 300
            while len(_log(marks)) <= last and time.monotonic() < until and driver.proc.poll() is None:
                time.sleep(0.2)  # inject only while the fit trains
            if driver.proc.poll() is not None:  # the fit ended: its row says why
                row = driver.row(30)
                raise AssertionError(f"the fit ended during the soak: {row.get('error')}\n"
                                     f"{row.get('traceback', '')[-3000:]}\n{driver.log.read_text()[-3000:]}")
            ranks = _ranks_now(marks, cluster)
            rank = rng.choice(sorted(ranks))
            k, pid = ranks[rank]
            kind = rng.choice(KINDS)
            attempt = _log(marks)[-1][0]
            at = time.time()
            fault = {"kind": kind, "host": k, "rank": rank, "at": at, "attempt": attempt, "end": at}
            if kind == "rank":
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    fault["kind"] = "rank (already gone)"
            elif kind == "executor":
                try:
                    os.kill(cluster.executor_pid(k), signal.SIGKILL)
                except (AssertionError, ProcessLookupError):
                    fault["kind"] = "executor (none running)"
            elif kind == "linkdown":
                seconds = rng.uniform(5, 30)
                cluster.sim.hosts[k].link(False)
                time.sleep(seconds)
                cluster.sim.hosts[k].link(True)
                fault["end"] = time.time()
            elif kind == "store":
                seconds, before = rng.uniform(2, 5), _upload_retries(cluster)
                frozen = [Path(d) for d, _, _ in os.walk(tmp_path / "store")]
                _immutable(frozen, True)
                time.sleep(seconds)
                _immutable(frozen, False)
                frozen = []
                fault["end"] = time.time()
                time.sleep(10)  # the writer's last retry is 7 s after the first failure
                if _upload_retries(cluster) == before:
                    fault["kind"] = "store (no upload during it)"
            else:
                _shape(cluster, k, "100mbit")
                time.sleep(30)
                _shape(cluster, k, "1gbit")
                fault["end"] = time.time()
            faults.append(fault)
        (marks / "stop").touch()
        row = driver.row(900)
        assert "error" not in row, f"{row['error']}\n{row.get('traceback', '')}\n{driver.log.read_text()[-4000:]}"
        leaks = {}
        for host in cluster.sim.hosts:
            found = job_processes(host, "") + _python_net_sockets(host)
            if found:
                leaks[host.name] = found
        threads = {h.name: _python_threads(h) for h in cluster.sim.hosts[1:]}
        run_id = re.search(r"run_elastic (\w+):", driver.log.read_text()).group(1)
        temps = _spark_hvd_temps(cluster, run_id)
    finally:
        _immutable(frozen, False)
        for h in cluster.sim.hosts:
            h.link(True)
        (marks / "done").touch()
        driver.close()

    log = _log(marks)
    cuts = attempt_cuts(log, {int(n): s for n, s in row["steps"].items()}, EVERY)
    table = _table(faults, log, cuts)
    print(table, file=sys.stderr)
    for f in faults:
        assert any(t > f["end"] for *_, t in log), f"no batch trained after the fault {f}"
    for name, want in row["replay"].items():
        np.testing.assert_allclose(row["weights"][name], want, rtol=1e-5, atol=1e-6, err_msg=name)
    assert not leaks, leaks
    assert not temps, temps
    print(f"threads of the Python processes left (idle Spark workers) by host: {threads}", file=sys.stderr)


def _table(faults: list[dict], log: list, cuts: dict) -> str:
    """Faults by kind: count, resets, grows, recovery (median, max), steps lost. A fault caused a reset when a later
    attempt started after it and before the next fault on no more ranks than the fault's attempt (a later attempt
    on more ranks is the fit growing back, counted apart: it stops training too, for a relaunch); its steps lost are
    the batches its attempt trained after its last checkpoint."""
    first: dict[int, float] = {}
    size: dict[int, int] = {}
    for a, _, _, n, t in log:
        first.setdefault(a, t)
        size.setdefault(a, n)
    by_kind: dict[str, list[dict]] = {}
    for i, f in enumerate(faults):
        times = [r[4] for r in log]
        before = [t for t in times if t <= f["at"]]
        after = [t for t in times if t > f["end"]]
        around = [t for t in times if before and after and before[-1] <= t <= after[0]]
        # training stopped for: the longest gap between two batches from the last before the fault to the first
        # after its end (a slowed link that training went through barely shows)
        f["recovery_s"] = max((b - a for a, b in zip(around[:-1], around[1:], strict=True)), default=float("nan"))
        upto = faults[i + 1]["at"] if i + 1 < len(faults) else float("inf")
        later = [a for a, t in first.items() if a > f["attempt"] and f["at"] < t <= upto]
        f["reset"] = any(size[a] <= size[f["attempt"]] for a in later)
        f["grow"] = sum(size[a] > size.get(a - 1, size[a]) for a in later)
        rows, kept = cuts.get(f["attempt"], ([], 0))
        f["lost"] = len(rows) - kept if f["reset"] else 0
        by_kind.setdefault(f["kind"], []).append(f)
    lines = [f"soak {SOAK_S:g} s, seed {SEED}: {len(faults)} faults, {len(first)} attempts, {len(log)} batches "
             "trained",
             f"{'fault':<24}{'n':>3}{'resets':>8}{'grows':>7}{'recovery median':>17}{'max':>8}{'steps lost':>12}"]
    for kind, items in sorted(by_kind.items()):
        rec = [f["recovery_s"] for f in items]
        lines.append(f"{kind:<24}{len(items):>3}{sum(f['reset'] for f in items):>8}{sum(f['grow'] for f in items):>7}"
                     f"{statistics.median(rec):>16.1f}s{max(rec):>7.1f}s{sum(f['lost'] for f in items):>12}")
    return "\n".join(lines)
