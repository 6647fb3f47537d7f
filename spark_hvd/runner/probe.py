"""Whether a task slot is free, asked of a session that cannot tell (Spark Connect): by running a one-task job.

A Spark Connect client has no ``SparkContext``: no status tracker, no executor list, so an elastic run there could
not see slots free up and never grew. ``SlotProbe`` asks the cluster itself: a one-task Spark job (a one-row
``range`` collected under a job tag of its own) that runs only if a task slot is free while the running attempt
holds its own. Its task ran: a slot was free (a proof, not an estimate). Not run within ``wait_s``: the answer is
no, and the job is cancelled (``interruptTag``; best effort: a Connect server may not find the operation yet, and
then the probe stays queued until a slot frees, which it then reports, taking that slot for milliseconds). Probes
run on a thread of their own, at most one at a time and one every ``every_s``, so the rank asking at its
checkpoint never waits for one: it gets the latest answer, and a "yes" is given once (the next probe must prove it
again).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from spark_hvd.runner import compat

logger = logging.getLogger(__name__)

#: Seconds between two probes (each one is a Spark job) and the longest a probe may wait for its slot.
PROBE_EVERY_S = float(os.environ.get("SPARK_HVD_SLOT_PROBE_EVERY", "5"))
PROBE_WAIT_S = float(os.environ.get("SPARK_HVD_SLOT_PROBE_WAIT", "3"))


class SlotProbe:
    """One-task jobs telling whether a slot is free (see the module docstring); ``tag`` names their jobs."""

    def __init__(self, spark: Any, tag: str, every_s: float = PROBE_EVERY_S, wait_s: float = PROBE_WAIT_S) -> None:
        self.spark, self.tag, self.every_s, self.wait_s = spark, tag, every_s, wait_s
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._started = -float("inf")
        self._free = False
        self.probes = 0

    def free(self) -> bool:
        """True once after a probe's task ran (a slot was free); starts the next probe when one is due."""
        with self._lock:
            answer, self._free = self._free, False
            running = self._thread is not None and self._thread.is_alive()
            if not running and time.monotonic() - self._started >= self.every_s:
                self._started = time.monotonic()
                self.probes += 1
                self._thread = threading.Thread(target=self._probe, name=f"{self.tag}-probe", daemon=True)
                self._thread.start()
        return answer

    def _probe(self) -> None:
        done = threading.Event()
        timer = threading.Timer(self.wait_s, lambda: done.is_set() or self._cancel())
        timer.daemon = True
        ran = False
        try:
            timer.start()
            with compat.tag_job(self.spark, self.tag, "spark_hvd: is a task slot free?"):
                ran = len(self.spark.range(0, 1, 1, 1).collect()) == 1
        except Exception:  # cancelled (no slot in time) or the session failed: no slot proven
            logger.debug("spark_hvd: slot probe %s did not run", self.tag, exc_info=True)
        finally:
            done.set()
            timer.cancel()
        with self._lock:
            self._free = self._free or ran

    def _cancel(self) -> None:
        try:
            compat.cancel_job(self.spark, self.tag)
        except Exception:
            logger.debug("spark_hvd: cancelling slot probe %s failed", self.tag, exc_info=True)

    def close(self, timeout_s: float = 10.0) -> None:
        """Cancel a probe still running and wait (bounded) for its thread."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._cancel()
            thread.join(timeout_s)
