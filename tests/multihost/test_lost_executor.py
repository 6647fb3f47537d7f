"""An executor JVM killed under ``local-cluster[3,1,1024]`` (three executor JVMs on this machine, no simulated
hosts): ``kill -9`` of the ``CoarseGrainedExecutorBackend`` whose Python worker runs the last rank, mid-epoch, in an
elastic ``TorchEstimator`` fit (``lost_host_driver.py``: 3 ranks, at least 2, step checkpoints every ``EVERY``
steps). Spark loses the executor, the barrier stage fails, the fit resumes from the last checkpoint and ends with
weights equal to a one-process replay of exactly the committed batches at each size; once the next attempt trains,
no process of the dead attempt (by the job id it inherited) is left among the driver's descendants.

The standalone twin is ``test_lost_host.py::test_executor_jvm_killed_the_stage_fails_and_the_fit_resumes``.
Cost: a driver and 3 executor JVMs, minutes on 2 loaded cores: marked ``hostloss`` (``make hostloss``).
"""

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

import numpy as np
import pytest
from lost_host_driver import attempt_cuts

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.hostloss]

DRIVER = str(Path(__file__).with_name("lost_host_driver.py"))
EVERY = 3
CFG = {"elastic": True, "num_proc": 3, "min_num_proc": 2, "max_num_proc": 3, "every": EVERY, "epochs": 3,
       "executors": 3}


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace")


def _executor_of(pid: int) -> int:
    """The executor JVM (``CoarseGrainedExecutorBackend``) above the process ``pid`` (a rank's Python worker)."""
    while pid > 1:
        if "CoarseGrainedExecutorBackend" in _cmdline(pid):
            return pid
        pid = _parent(pid)
    raise AssertionError("the rank's process has no executor JVM above it")


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                children.setdefault(_parent(int(name)), []).append(int(name))
            except (OSError, ValueError, IndexError):
                continue
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _of_attempt(pids: set[int], suffix: str) -> list[str]:
    """Those of ``pids`` that inherited a spark_hvd job id ending with ``suffix``: ``pid cmdline``."""
    found = []
    for pid in sorted(pids):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            job = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"SPARK_HVD_JOB_ID=")), None)
            if job is not None and job.endswith(suffix):
                found.append(f"{pid} {_cmdline(pid)[:200]}")
        except OSError:
            continue
    return found


class _Driver:
    """``lost_host_driver.py`` on ``local-cluster``: its stderr in ``log``, its JSON lines read on a thread."""

    def __init__(self, tmp_path: Path) -> None:
        self.marks = tmp_path / "marks"
        self.marks.mkdir()
        self.log = tmp_path / "driver.log"
        env = {**os.environ, "SIM_DRIVER_ADDRESS": "127.0.0.1", "SPARK_LOCAL_IP": "127.0.0.1",
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, DRIVER, "local-cluster[3,1,1024]", str(tmp_path / "store"), str(self.marks),
                 json.dumps(CFG)], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, text=True,
                start_new_session=True)
        self.rows: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.rows.put(json.loads(line))
        self.rows.put(None)

    def row(self, within_s: float) -> dict:
        try:
            row = self.rows.get(timeout=within_s)
        except queue.Empty:
            row = None
        assert row is not None, f"the driver printed no row within {within_s:.0f}s:\n{self.log.read_text()[-6000:]}"
        return row

    def batches(self) -> list[tuple[int, int, int, int, float]]:
        path = self.marks / "batches.log"
        rows = [line.split() for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        return [(int(a), int(e), int(s), int(n), float(t)) for a, e, s, n, t in rows if t]

    def wait_batch(self, ok, what: str, within_s: float = 300.0) -> tuple:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            found = [row for row in self.batches() if ok(row)]
            if found:
                return found[0]
            time.sleep(0.2)
        raise AssertionError(f"no batch {what} within {within_s:.0f}s (driver exit {self.proc.poll()}):\n"
                             f"{self.batches()[-5:]}\n{self.log.read_text()[-4000:]}")

    def close(self) -> None:
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.mark.timeout(900)
def test_executor_jvm_killed_under_local_cluster_the_elastic_fit_resumes(tmp_path):
    driver = _Driver(tmp_path)
    try:
        driver.row(300)  # {"started": ...}: the three executors registered, the fit begins
        driver.wait_batch(lambda r: r[0] == 0 and (r[1], r[2]) >= (1, 3), "of epoch 1")
        ranks = sorted(driver.marks.glob("rank-0-*"), key=lambda p: int(p.name.rsplit("-", 1)[1]))
        victim = _executor_of(int(ranks[-1].read_text().split()[1]))
        os.kill(victim, signal.SIGKILL)
        lost_at = time.time()
        (driver.marks / "lost").touch()  # the ranks stop throttling
        again = driver.wait_batch(lambda r: r[0] > 0, "of an attempt after the first")
        left = _of_attempt(_descendants(driver.proc.pid), "a0")
        assert left == [], f"processes of the dead attempt still run: {left}"
        row = driver.row(600)
    finally:
        driver.close()
    assert "error" not in row, f"{row['error']}\n{row.get('traceback', '')}\n{driver.log.read_text()[-4000:]}"
    cuts = attempt_cuts(driver.batches(), {int(n): k for n, k in row["steps"].items()}, EVERY)
    lost = [len(rows) - kept for rows, kept in cuts.values()][:-1]
    sizes = [n for i, (_, _, n) in enumerate(row["kept"]) if i == 0 or row["kept"][i - 1][2] != n]
    print(f"\nexecutor killed (local-cluster): recovery_s={again[4] - lost_at:.1f}, fit_s={row['fit_s']:.1f}, "
          f"steps_lost={lost}, sizes={sizes}", file=sys.stderr)
    assert len(cuts) >= 2, "the fit was not relaunched"
    assert max(lost, default=0) <= EVERY, lost
    for name, want in row["replay"].items():
        np.testing.assert_allclose(row["weights"][name], want, rtol=1e-5, atol=1e-6, err_msg=name)
    log = driver.log.read_text()
    assert re.search(r"Lost executor \d+ on ", log), log[-4000:]
    assert re.search(r"relaunching \(reset 1\) after ", log), log[-4000:]
