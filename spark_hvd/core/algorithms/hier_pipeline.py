"""The hierarchical allreduce's three legs, pipelined: shared memory within the host overlaps TCP between hosts.

The split hierarchical allreduce (``RingBackend``, every host with as many ranks) is a shared-memory
reduce-scatter within the host (local rank i ends up holding slice i reduced over the host), an allreduce of each
slice across hosts by the local rank that holds it (TCP), and a shared-memory allgather within the host. Run one
after the other, the link sits idle during both shared-memory legs (about a tenth of a 64 MiB allreduce across two
simulated hosts at 2 Gbit/s, issue 23). Here every slice is cut into pieces and a helper thread runs the
shared-memory legs piece by piece (the reduce-scatter of every piece in order, then the allgather of each piece as
soon as the calling thread has carried it across hosts; the first piece's reduce-scatter and the last piece's
allgather run in the calling thread itself), so the link is idle only for the first piece's
reduce-scatter and the last piece's allgather; those two pieces are small (``piece_sizes``: a ramp of 256 KiB, 1 MiB,
then pieces of 2-8 MiB, and down again), so that idle time is a fraction of a millisecond, not the 2-4 ms of a
full piece (benchmarks/RESULTS.md, issue 23, round 3 session 6: 2 hosts x 2 ranks).

Threads: the helper alone uses the ``ShmGroup`` and the local peers' sockets (to check they are alive, through its
own ``PeerWatcher``); the calling thread alone uses the cross-host connections. Every member of the host cuts the
same pieces and runs the same sequence of shared-memory rounds. A failure on either side stops the other: the
helper's error is raised in the calling thread; an error of the calling thread makes the helper give up at its
next check (within milliseconds) and is raised once the helper has stopped (bounded by the timeout).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

import numpy as np

from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.errors import CollectiveTimeoutError, SparkHvdError
from spark_hvd.core.transport.shm import ShmGroup
from spark_hvd.core.transport.shm_slices import allgather_parts, reduce_scatter_parts, split

#: Each local rank's slice is cut into pieces of at least this many bytes ...
PIECE_MIN_BYTES = 2 * 1024 * 1024
#: ... and at most this many pieces (each piece is one TCP allreduce: a start and an end of its ring) ...
MAX_PIECES = 8
#: ... plus, when it is cut, a ramp at each end: pieces of PIECE_MIN_BYTES / 8, then RAMP times larger, up to the
#: others' size. The link waits for the first piece's shared-memory reduce before its first byte and the caller
#: for the last piece's shared-memory allgather after the link's last one: small end pieces keep both short,
#: and the shared-memory leg of each next piece (RAMP times larger) still finishes while the link carries this one.
RAMP = 4
#: The calling thread reduces this many pieces itself before the helper takes over: the first two (256 KiB and
#: 1 MiB) cost it ~1 ms, where waiting for the helper to wake up and reduce the second cost ~2 ms (traced).
HEAD_PIECES = 2


class _Abandoned(SparkHvdError):
    """The calling thread failed; the helper stops (never seen outside this module)."""


class Helper:
    """The thread that runs the pipeline's shared-memory legs: one per backend, started at its first use and kept
    (a thread started per call costs the calling thread a hand-off, ~1 ms on a busy machine, before its first
    byte goes out), stopped by ``close``. Runs one job at a time, in order."""

    def __init__(self, name: str = "spark-hvd-hier") -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` (which handles its own errors) on the thread, after the jobs before it."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread once the jobs before this are done (waits up to ``timeout_s``)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout_s)
            self._thread = None


def pieces_for(slice_bytes: int) -> int:
    """How many full-size pieces a slice of ``slice_bytes`` is cut into (1: no pipeline)."""
    return max(1, min(MAX_PIECES, slice_bytes // PIECE_MIN_BYTES))


def piece_sizes(slice_bytes: int) -> list[int]:
    """The bytes of each piece of a slice of ``slice_bytes``, in order (summing to it; one piece: no pipeline):
    ``pieces_for`` pieces of equal size, but for a ramp at each end (``RAMP``)."""
    nblocks = pieces_for(slice_bytes)
    if nblocks == 1:
        return [slice_bytes]
    full = -(-slice_bytes // nblocks)
    ramp: list[int] = []
    step = max(1, PIECE_MIN_BYTES // 8)
    while step < full and 2 * (sum(ramp) + step) < slice_bytes:
        ramp.append(step)
        step *= RAMP
    middle = slice_bytes - 2 * sum(ramp)
    count = max(1, -(-middle // full))
    body = [middle * (k + 1) // count - middle * k // count for k in range(count)]
    return ramp + body + ramp[::-1]


def allreduce(group: ShmGroup, flat: np.ndarray, bounds: Sequence[int], op: ReduceOp, bfloat16: bool,
              operation: str, cross: Callable[[np.ndarray], None], check_local: Callable[[str], None],
              timeout_s: float, helper_thread: Helper) -> None:
    """Allreduce ``flat`` in place: member i of ``group`` reduces slice ``bounds[i]:bounds[i+1]`` over the host,
    ``cross(view)`` allreduces a piece of it across hosts in place (and divides for an average), and the slices
    are shared within the host again. ``op`` AVERAGE must come as SUM (``cross`` divides). ``check_local`` raises
    if a local peer failed; ``timeout_s`` bounds every wait of the calling thread on the helper; ``helper_thread``
    runs the shared-memory legs of the pieces in between."""
    parts = split(flat, bounds, group.size)
    widest = max(p.nbytes for p in parts)
    sizes = piece_sizes(widest)
    nblocks = len(sizes)
    if nblocks == 1:
        reduce_scatter_parts(group, parts, op, bfloat16, operation, check_local)
        cross(parts[group.local])
        allgather_parts(group, parts, operation, check_local)
        return
    ends = [sum(sizes[:k]) for k in range(nblocks + 1)]  # where piece k starts in the widest slice, in bytes
    cuts = [[(len(p) * e) // widest for e in ends] for p in parts]
    pieces = [[p[c[k]:c[k + 1]] for p, c in zip(parts, cuts, strict=True)] for k in range(nblocks)]
    head = min(HEAD_PIECES, nblocks - 1)
    reduced = [threading.Event() for _ in range(nblocks)]
    carried: queue.Queue[int] = queue.Queue()
    failed: list[BaseException] = []
    abandon = threading.Event()
    finished = threading.Event()

    def check(what: str) -> None:
        if abandon.is_set():
            raise _Abandoned(what)
        check_local(what)

    def helper() -> None:
        try:
            for k in range(head, nblocks):
                reduce_scatter_parts(group, pieces[k], op, bfloat16, operation, check)
                reduced[k].set()
            for k in range(nblocks - 1):
                while True:
                    try:
                        got = carried.get(timeout=0.05)
                        break
                    except queue.Empty:
                        check(operation)
                assert got == k
                allgather_parts(group, pieces[k], operation, check)
        except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
            failed.append(exc)
            for event in reduced:
                event.set()
        finally:
            finished.set()

    # the first pieces' reduce (``HEAD_PIECES``) and the last piece's allgather run in the calling thread (before
    # the helper's job starts, after it ended): the link's first bytes and the caller's return wait for no thread's
    # wake-up, and the helper has the first pieces' crossing to reduce the next one
    for k in range(head):
        reduce_scatter_parts(group, pieces[k], op, bfloat16, operation, check_local)
    helper_thread.submit(helper)
    try:
        for k in range(nblocks):
            if k >= head and not reduced[k].wait(timeout_s + 5.0):
                raise CollectiveTimeoutError(f"{operation}: the shared-memory reduce within this host did not "
                                             f"finish within {timeout_s:.0f}s")
            if failed:
                raise failed[0]
            cross(pieces[k][group.local])
            if k < nblocks - 1:
                carried.put(k)
        if not finished.wait(timeout_s + 5.0):
            raise CollectiveTimeoutError(f"{operation}: the shared-memory allgather within this host did not "
                                         f"finish within {timeout_s:.0f}s")
        if failed:
            raise failed[0]
    except BaseException:
        abandon.set()
        finished.wait(timeout_s + 5.0)
        raise
    allgather_parts(group, pieces[-1], operation, check_local)


__all__ = ["allreduce", "Helper", "pieces_for", "piece_sizes", "PIECE_MIN_BYTES", "MAX_PIECES", "RAMP"]
