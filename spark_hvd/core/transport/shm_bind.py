"""The shared-memory ranks of one host on CPUs of their own, as Open MPI binds its ranks (``SPARK_HVD_SHM_BIND=1``).

The ranks of a shared-memory group wait for each other by spinning briefly, then sleeping on a futex that the peer
wakes (``spark_hvd.core.transport.shm``). Left to itself, the scheduler tends to wake a sleeping rank on its waker's
CPU (the waker is running, its cache is warm), so both ranks of a collective end up queued on one CPU: each spin
then keeps the very peer it waits for from running, every hand-over costs a scheduler slice instead of a few
microseconds, and the ranks leave each collective tens of microseconds apart. On a 2-core host at load 36, two
ranks timing ``hvd.barrier(); hvd.allreduce_(t)`` (4 KiB) took 370-450 us a call, leaving the barrier 120 us apart,
and 22-40 us, leaving it 0.6-4 us apart, with each rank held to a CPU of its own (2026-12-07; the figures of
``benchmarks/allreduce.py --after-barrier`` with and without it are in benchmarks/RESULTS.md).

Unbound, the compiled small path gets most of that (``shm``: a rank spinning for a peer that last waited on its own
CPU moves itself off it, ``SPARK_HVD_SHM_MOVE``): the ranks leave a barrier 0.1-0.3 us apart there too.

It is off by default: a rank held to its share cannot escape a CPU that other processes keep busy, and on the same
host at load 54 back-to-back allreduces took 7.1 ms (4 KiB) and 121 ms (16 MiB) bound against 1.1 and 66 ms
unbound. Turn it on where the ranks have the host's CPUs to themselves (a dedicated training host), as mpirun's
default binding assumes.

``bind`` gives local rank ``i`` of ``n`` the ``i``-th of ``n`` equal shares of the CPUs the process may run on (all
of them when there are fewer CPUs than ranks, or one rank: then nothing changes), for the calling thread: the thread
that creates the group, normally the one that calls ``init()`` and later the collectives, and every thread it starts
afterwards (the engine's thread, a framework's thread pool) inherit it. A share keeps a rank's compute threads their
fair part of the host. ``ShmGroup.close`` gives every thread still held to the share
its old set back, so a Spark Python worker reused by a later task (and its thread pools) runs unbound again.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


def enabled() -> bool:
    """Whether ``SPARK_HVD_SHM_BIND`` asks for the ranks to be bound (``1`` / ``true`` / ``yes`` / ``on``; off by
    default)."""
    return os.environ.get("SPARK_HVD_SHM_BIND", "").strip().lower() in ("1", "true", "yes", "on")


def share(cpus: list[int], local: int, size: int) -> list[int]:
    """Local rank ``local``'s share of ``cpus`` among ``size`` ranks: the ``local``-th of ``size`` equal runs of the
    sorted CPUs (the remainder left to no one), or all of them where there are fewer CPUs than ranks."""
    cpus = sorted(cpus)
    if size < 2 or len(cpus) < size:
        return cpus
    per = len(cpus) // size
    return cpus[local * per:(local + 1) * per]


def bind(local: int, size: int) -> Callable[[], None] | None:
    """Bind the calling thread to local rank ``local``'s share of its CPUs (``share``); return what restores its
    old set, or None when nothing was bound (not asked for, one rank, fewer CPUs than ranks, no affinity calls)."""
    if size < 2 or not enabled() or not hasattr(os, "sched_setaffinity"):
        return None
    try:
        before = sorted(os.sched_getaffinity(0))
    except OSError:
        return None
    mine = share(before, local, size)
    if mine == before:
        return None
    try:
        os.sched_setaffinity(0, mine)
    except OSError as exc:  # a container that forbids it: run unbound
        logger.debug("could not bind local rank %d to CPUs %s: %s", local, mine, exc)
        return None
    bound = set(mine)

    def restore() -> None:
        """Every thread of the process still held to the share (the binding thread and those it started since, a
        thread pool's included) gets its old set back; a thread someone set otherwise is left as it is."""
        for tid in _threads():
            try:
                if os.sched_getaffinity(tid) == bound:
                    os.sched_setaffinity(tid, before)
            except OSError:  # the thread has ended
                pass

    return restore


def _threads() -> list[int]:
    """The native ids of this process's threads (``/proc/self/task``; the calling thread alone without it)."""
    try:
        return [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:
        return [threading.get_native_id()]
