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

import os
import re
import signal

import pytest
from test_lost_host import ELASTIC, _assert_replayed, _Fit, _report, _sizes

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.hostloss]


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


@pytest.mark.timeout(900)
def test_executor_jvm_killed_under_local_cluster_the_elastic_fit_resumes(tmp_path):
    fit = _Fit(None, tmp_path, {**ELASTIC, "epochs": 3}, master="local-cluster[3,1,1024]")
    fit.wait_batch(lambda r: r[0] == 0 and (r[1], r[2]) >= (1, 3), "of epoch 1")
    ranks = sorted(fit.marks.glob("rank-0-*"), key=lambda p: int(p.name.rsplit("-", 1)[1]))
    os.kill(_executor_of(int(ranks[-1].read_text().split()[1])), signal.SIGKILL)
    lost_at = fit.lost()
    again = fit.wait_batch(lambda r: r[0] > 0, "of an attempt after the first")
    left = _of_attempt(_descendants(fit.driver.proc.pid), "a0")
    assert left == [], f"processes of the dead attempt still run: {left}"
    row = fit.result()
    _report("executor killed (local-cluster)", recovery_s=again[4] - lost_at, fit_s=row["fit_s"],
            steps_lost=row["lost"], sizes=_sizes(row))
    assert len({r[0] for r in fit.log()}) >= 2, "the fit was not relaunched"
    _assert_replayed(row)
    log = fit.driver.log.read_text()
    assert re.search(r"Lost executor \d+ on 127\.0\.0\.1", log), log[-4000:]
    assert re.search(r"relaunching \(reset 1\) after ", log), log[-4000:]
