"""Horovod's ``callbacks`` of ``RayExecutor.run`` / ``execute``: every value rank 0 reports, handed to callbacks.

A rank reports with the runner's ``spark_hvd.runner.report(epoch=..., step=..., **metrics)`` (Horovod's workers
used ``ray_logger.log(dict)``); the event travels over the rank's authenticated connection to the job's driver
service (``spark_hvd.runner.service``), whose thread queues rank 0's events here. The executor calls ``deliver``
on the caller's own thread while it waits for the ranks (so a callback may call ``ray.tune.report``), each callback
with the event's metrics (``epoch`` and ``step`` added when given). Every rank's function is wrapped so that rank 0
reports a last marker after it returned: events of one connection arrive in order, so once the marker is here, so
is every report before it.

Rank 0's checkpoints (``spark_hvd.ray.tune.report(metrics, checkpoint=...)``) come as requests of the driver
service's handler ``checkpoints.REQUEST`` on the same connection, so they are queued here in order with the events;
a callback with ``takes_checkpoint = True`` (the Tune trial's) gets them as ``callback(metrics,
checkpoint=NodeCheckpoint)``, the others the metrics alone.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from spark_hvd.ray.checkpoints import Offer, Offers

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
        self._lock = threading.Lock()  # an offer is queued only while a run is active
        self._offers = Offers()
        self.done = False

    def on_event(self, event: Any) -> None:
        """The driver service's ``on_event`` (its thread)."""
        if event.rank == 0 and self._active.is_set():
            self._queue.put(event)

    def on_checkpoint(self, rank: int, payload: dict[str, Any]) -> Any:
        """The driver service's handler of ``checkpoints.REQUEST`` (its thread): an offer of rank 0's checkpoint
        (its ticket), or the state of one (``Offers.wait``)."""
        if payload.get("op") == "wait":
            return self._offers.wait(int(payload["ticket"]))
        if rank != 0:
            raise ValueError(f"rank {rank} offered a checkpoint: only rank 0's are the trial's")
        with self._lock:
            if not self._active.is_set():
                raise RuntimeError("no run with callbacks is waiting for checkpoints (run(fn, callbacks=...) of a "
                                   "fixed-size job takes them; an elastic job does not)")
            offer = self._offers.make(payload)
            self._queue.put(offer)
        return offer.ticket

    def begin(self) -> None:
        """A run with callbacks starts: queue rank 0's events."""
        while not self._queue.empty():
            self._queue.get_nowait()
        self.done = False
        self._active.set()

    def end(self) -> None:
        """The run ended: stop queueing; checkpoints not taken fail on rank 0."""
        with self._lock:
            self._active.clear()
        self._offers.fail_all("the run ended before the trial took this checkpoint")

    def deliver(self, callbacks: Sequence[Callable[[dict[str, Any]], Any]]) -> None:
        """Hand every queued event to every callback (on this thread), until the queue is empty."""
        while True:
            try:
                event = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(event, Offer):
                self._take(event, callbacks)
                continue
            if event.metrics.get(DONE):
                self.done = True
                continue
            metrics = dict(event.metrics)
            for name in ("epoch", "step"):
                if getattr(event, name) is not None:
                    metrics.setdefault(name, getattr(event, name))
            for callback in callbacks:
                callback(metrics)

    @staticmethod
    def _take(offer: Offer, callbacks: Sequence[Callable[..., Any]]) -> None:
        """Hand a checkpoint to the callbacks that take one (the metrics alone to the others), then tell rank 0
        (whether it was taken, or why not; the callback's exception goes on up here too)."""
        try:
            for callback in callbacks:
                if getattr(callback, "takes_checkpoint", False):
                    callback(dict(offer.metrics), checkpoint=offer.checkpoint)
                else:
                    callback(dict(offer.metrics))
        except BaseException as exc:
            offer.error = f"the trial failed to take the checkpoint: {type(exc).__name__}: {exc}"
            raise
        finally:
            offer.taken.set()
