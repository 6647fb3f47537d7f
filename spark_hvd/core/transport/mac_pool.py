"""A few threads that compute the GMAC tags of large DATA frames off the ring's calling thread.

Every DATA frame carries AES-256-GCM's tag over its payload (``wire``), and at N=2 a 64 MiB allreduce tags 64 MiB
and checks 64 MiB per rank: ~15% of a link-bound ring's CPU (issue 23). ``cryptography`` hashes without the GIL,
so a pool thread can tag the next frame to send, or check the frame just received, while the calling thread
copies other frames through the kernel and reduces: on a host with a spare core the MAC leaves the critical path.
The order of frames and the rule that no payload is used before its tag checks out stay with the caller
(``tcp.RingExchange``): a job only computes a tag, the caller compares it and decides.

A job is a callable; the pool runs jobs first in, first out on its threads and, after each, writes to an eventfd
(``fileno``) that the caller's ``poll`` watches if the caller said it is ``waiting``, so a caller that waits on
sockets wakes as soon as a tag is ready. One caller at a time per pool (the eventfd's wake-ups are not addressed).
``threads`` follows the cores the rank may use (``threads_for``; the setting ``SPARK_HVD_MAC_THREADS``).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: With the setting unset, at most this many pool threads per rank
MAX_AUTO_THREADS = 3
#: With the setting unset, a rank gets a pool only where it may use at least this many cores of its own
AUTO_MIN_CORES = 2


def threads_for(setting: int | None, local_size: int) -> int:
    """Pool threads for a rank: ``setting`` if given (0: no pool, every tag in the calling thread), else one
    less than the cores this process may run on (``os.sched_getaffinity``) shared among the ``local_size``
    ranks of its host, at most ``MAX_AUTO_THREADS``, and none below ``AUTO_MIN_CORES`` cores per rank."""
    if setting is not None:
        return max(0, setting)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    mine = cores // max(1, local_size)
    return min(MAX_AUTO_THREADS, mine - 1) if mine >= AUTO_MIN_CORES else 0


class MacJob:
    """One computation on the pool: ``done`` once ``result`` (or ``error``) is set."""

    __slots__ = ("fn", "args", "result", "error", "done", "cancelled")

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self.fn, self.args = fn, args
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = False
        self.cancelled = False

    def value(self) -> Any:
        """The result (only once ``done``); re-raises the job's error."""
        if self.error is not None:
            raise self.error
        return self.result


class MacPool:
    """``threads`` daemon threads running submitted jobs; see the module docstring."""

    def __init__(self, threads: int, name: str = "spark-hvd-mac") -> None:
        if threads < 1:
            raise ValueError(f"a MAC pool needs at least one thread, not {threads}")
        self.threads = threads
        self._jobs: queue.SimpleQueue[MacJob | None] = queue.SimpleQueue()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._closed = False
        #: set by the caller before it checks the jobs it waits for and sleeps in ``poll``; a finished job
        #: writes the eventfd only then (a system call saved per job while the caller is busy)
        self.waiting = False
        self._workers = [threading.Thread(target=self._run, name=f"{name}-{k}", daemon=True) for k in range(threads)]
        for worker in self._workers:
            worker.start()

    def fileno(self) -> int:
        """An eventfd, readable once a job finished since the last ``clear``."""
        return self._wake

    def clear(self) -> None:
        """Reset the eventfd (after ``poll`` found it readable)."""
        try:
            os.eventfd_read(self._wake)
        except (BlockingIOError, OSError):
            pass

    def submit(self, fn: Callable[..., Any], *args: Any) -> MacJob:
        """Queue ``fn(*args)``; the caller reads the job's ``done`` / ``value()``."""
        job = MacJob(fn, args)
        self._jobs.put(job)
        return job

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.cancelled:  # its caller gave up (an error): nothing waits for it
                continue
            try:
                job.result = job.fn(*job.args)
            except BaseException as exc:  # handed to the caller by value()
                job.error = exc
            job.done = True
            if self.waiting:  # the caller sleeps in poll (set before it last looked at ``done``: no lost wake-up)
                try:
                    os.eventfd_write(self._wake, 1)
                except OSError:  # closed under us at shutdown
                    return

    def close(self) -> None:
        """Stop the threads (after the jobs queued before) and release the eventfd."""
        if self._closed:
            return
        self._closed = True
        for _ in self._workers:
            self._jobs.put(None)
        for worker in self._workers:
            worker.join(5.0)
        try:
            os.close(self._wake)
        except OSError:
            pass
