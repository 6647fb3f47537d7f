"""Horovod's ``callbacks`` of ``RayExecutor.run`` / ``execute``: every value rank 0 reports, handed to callbacks.

A rank reports with the runner's ``spark_hvd.runner.report(epoch=..., step=..., **metrics)`` (Horovod's workers
used ``ray_logger.log(dict)``); the event travels over the rank's authenticated connection to the job's driver
service (``spark_hvd.runner.service``), whose thread queues rank 0's events here. The executor calls ``deliver``
on the caller's own thread while it waits for the ranks (so a callback may call ``ray.tune.report``), each callback
with the event's metrics (``epoch`` and ``step`` added when given). Every rank's function is wrapped so that rank 0
reports a last marker after it returned: events of one connection arrive in order, so once the marker is here, so
is every report before it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

#: The metric name of rank 0's last report (never handed to a callback).
DONE = "_spark_hvd_reports_done"


def then_mark(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Runs on every rank: ``fn(*args, **kwargs)``, then, on rank 0, the last marker report."""
    import spark_hvd.core as core
    from spark_hvd.runner import report

    result = fn(*args, **kwargs)
    if core.rank() == 0:
        report(**{DONE: True})
    return result


class RankZeroReports:
    """Rank 0's events of the current ``run`` (queued only while a run with callbacks is active)."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._active = threading.Event()
        self.done = False

    def on_event(self, event: Any) -> None:
        """The driver service's ``on_event`` (its thread)."""
        if event.rank == 0 and self._active.is_set():
            self._queue.put(event)

    def begin(self) -> None:
        """A run with callbacks starts: queue rank 0's events."""
        while not self._queue.empty():
            self._queue.get_nowait()
        self.done = False
        self._active.set()

    def end(self) -> None:
        """The run ended: stop queueing."""
        self._active.clear()

    def deliver(self, callbacks: Sequence[Callable[[dict[str, Any]], Any]]) -> None:
        """Hand every queued event to every callback (on this thread), until the queue is empty."""
        while True:
            try:
                event = self._queue.get_nowait()
            except queue.Empty:
                return
            if event.metrics.get(DONE):
                self.done = True
                continue
            metrics = dict(event.metrics)
            for name in ("epoch", "step"):
                if getattr(event, name) is not None:
                    metrics.setdefault(name, getattr(event, name))
            for callback in callbacks:
                callback(metrics)
