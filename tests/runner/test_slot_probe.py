"""``SlotProbe`` on a Spark Connect session (which cannot tell free slots): while classic jobs hold both slots of the
shared local[2] session, its probes never say "free" (their one task cannot start); once the slots are released, a
probe runs and says so."""

from __future__ import annotations

import os
import threading
import time

import pytest

from spark_hvd.runner.probe import SlotProbe
from spark_hvd.runner.slots import slots

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def _hold(spark, release: str, tasks: int) -> threading.Thread:
    """A job of ``tasks`` tasks each holding a slot until ``release`` exists; returned once they all run."""
    def hold(_) -> None:
        deadline = time.monotonic() + 120
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.05)

    thread = threading.Thread(target=lambda: spark.sparkContext.parallelize(range(tasks), tasks).foreach(hold),
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while slots(spark.sparkContext)[0] > 2 - tasks and time.monotonic() < deadline:
        time.sleep(0.1)
    assert slots(spark.sparkContext)[0] == 2 - tasks, "the holder did not take its slots"
    return thread


@pytest.mark.timeout(300)
def test_a_probe_says_free_only_when_its_task_ran(spark, spark_connect, tmp_path):
    release = str(tmp_path / "release")
    holder = _hold(spark, release, 2)
    probe = SlotProbe(spark_connect, "spark_hvd-test-probe", every_s=0.5, wait_s=2.0)
    try:
        answers, until = [], time.monotonic() + 3 * (probe.every_s + probe.wait_s)
        while time.monotonic() < until:  # several probes' worth of asking (not a timed assertion: none may say yes)
            answers.append(probe.free())
            time.sleep(0.2)
        assert probe.probes >= 1 and not any(answers), "a probe said a slot was free while both were held"
    finally:
        open(release, "w").close()
        holder.join(60)
    deadline = time.monotonic() + 120
    while not probe.free():
        assert time.monotonic() < deadline, "no probe ran within 120 s of a slot being released"
        time.sleep(0.2)
    probe.close()
