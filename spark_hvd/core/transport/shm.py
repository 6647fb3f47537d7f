"""Shared-memory allreduce between the ranks of one host.

Each rank owns one POSIX shared-memory segment (``/dev/shm/spark_hvd-<job>-<rank>-<nonce>``): a control page of
monotonic counters (one 64-byte cache line each) and a staging area of ``nslots`` slots of ``block_bytes``. Peers
map each other's segments read-only. Every rank unlinks the names as soon as all ranks have mapped them, so a
crash later leaves nothing in /dev/shm.

A large buffer is processed as a pipeline of blocks, one slot each, round robin. For block ``g`` (a sequence
number shared by all ranks, counting from 1 over the life of the group):

* copy-in: wait until every peer finished block ``g - nslots`` (its slot is free again), copy this rank's part
  of the block into its slot, publish ``IN = g``;
* two ranks (``direct``): wait for the peer's ``IN >= g``, reduce ``out = mine + peer's slot`` straight into the
  caller's buffer (addition, product, min and max commute, so both ranks get identical bits), publish ``OUT = g``;
* more ranks (``scatter``): rank r reduces the r-th chunk of the block over all slots into its own slot and
  publishes ``RED = g``; then every rank copies every chunk out of its owner's slot and publishes ``OUT = g``.
  Small blocks reduce every slot in rank order on every rank instead (one wait less, identical bits).

The copy-in of block ``g + 1`` runs before the copy-out of block ``g``, so ranks overlap copy, reduce and wait.
``rounds`` runs the same protocol for exchanges that are not an allreduce of one array (``shm_slices``: the
reduce-scatter and allgather of the hierarchical allreduce): stage into one's slot, ``IN``, read the peers' slots,
``OUT``.
x86 keeps stores in order, so a counter is published after the data it covers with a plain store. A wait spins
briefly, then yields and sleeps with a growing back-off; every few milliseconds it checks that the peers are alive
(their TCP connections, via ``check_peers``) and it gives up after ``timeout_s`` naming the rank it waited for.

A small allreduce (one array of at most ``small_bytes``, the barrier's included) and the barrier's release run in C
where the compiled loop was built (``_ringloop.shm_small`` / ``shm_release``, the same counters and bits): one copy
into the slot, ``IN``, the wait, the reduction, ``OUT``, with no Python between them (0.44 us a call without
waiting). Its waits spin ``SMALL_SPIN_S`` before they sleep (ranks no more than cores; none otherwise) and publish
the CPU they spin on: a rank that finds its peer last waited on its own CPU (the scheduler woke one onto its
waker's core, where every spin keeps the other from running) moves itself off that CPU (its CPU set without it,
then its set back at once: not a binding) or yields. A publication from C makes the futex wake call only where a
peer's ``SLEEP`` word says it sleeps on that counter (every wait that sleeps, Python's too, sets it first).
``small_agreed`` (``_ringloop.shm_agreed``) is the same synchronisation with an 8-byte flag ahead of the data in the
slot: every rank reads every flag after ``IN`` and reduces only if all are set (a rank that does not agree writes
its flag alone), so the engine's speculative round of one small tensor or of a barrier is one small allreduce with
no staging copy in or out (``Backend.agrees_small``; compiled ranks only, and every rank of the job must be).

Over 600 lines on purpose: the block pipeline (one ``_BlockAllreduce`` per call), its two reduction schemes, the
broadcast, the exchange rounds and the waits all follow the one counter protocol above, which is easiest to check
in one place (what the rounds carry is in ``shm_slices``).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.errors import CollectiveTimeoutError, PeerFailureError
from spark_hvd.core.reduce import divide_average, reduce_into, ufunc_for

try:
    from spark_hvd.core.transport import _ringloop
    from spark_hvd.core.transport.ringloop import _BF16, _DTYPES, _OPS
except ImportError:  # not built here: the small path runs in Python (the same protocol)
    _ringloop = None
if not hasattr(_ringloop, "shm_small"):  # built without it (not Linux)
    _ringloop = None

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
CTRL_BYTES = 4096
# control words (int64 index into the control page), one cache line apart
IN, RED, OUT, PID = 0, 8, 16, 24  # PID + 1: this mapping's address (shm_cma); shm_cma uses 32..
#: set while this rank sleeps on a peer's counter, ``1 + k * 512 + word`` (k the peer's index, word the counter's):
#: the compiled small path (``_ringloop.shm_small``) makes the futex wake call only where a peer's SLEEP names the
#: counter it publishes (the PID line: no busy counter shares it) ...
SLEEP = PID + 2
#: ... and, written by the compiled path where it changed, 1 + the CPU this rank last spun on (``SMALL_SPIN_S``)
CPU = PID + 3
SPIN_CHECKS = 500
#: The compiled small path's waits spin this long before they sleep on the futex (ranks no more than cores): the
#: ranks of a collective right after a barrier, or back to back, arrive a few microseconds apart, and a rank that
#: slept is woken by the scheduler on its waker's core, where both then queue (``shm_bind``'s docstring)
SMALL_SPIN_S = 100e-6
#: ... after this long spinning each look yields the core first (the peer may be queued on this very one)
SMALL_YIELD_S = 20e-6
#: ... a rank that finds its peer last waited on its own CPU moves itself off it (``SPARK_HVD_SHM_MOVE=0``: yields)
MOVE_OFF_PEER = os.environ.get("SPARK_HVD_SHM_MOVE", "1") != "0"
#: ... and after this long in all it goes back to Python, which checks the peers are alive and waits on
SMALL_BUDGET_S = 0.002
#: ``release``: how long a rank spins at most for its peers to finish a barrier (their wake-up from a futex took
#: 30-150 us on a loaded 2-core host; a peer later than this has been preempted, and the caller goes on) ...
RELEASE_SPIN_S = 0.002
#: ... and after this long it yields its core at every look: on a loaded host the scheduler tends to put two ranks
#: that wake each other on one core, where spinning would only keep the peer from running.
RELEASE_YIELD_S = 50e-6
#: Whether ``attach`` sets the group up for the compiled small path where it was built (tests turn it off to check
#: the two paths give the same bits; ranks may run either: the protocol is the same)
COMPILED_SMALL = True
_SMALL_YIELD_NS, _SMALL_BUDGET_NS = int(SMALL_YIELD_S * 1e9), int(SMALL_BUDGET_S * 1e9)
#: Below this many bytes a block is reduced in full by every rank (one synchronisation instead of two).
SMALL_BLOCK = 64 * 1024
#: the flag ahead of the data of ``ShmGroup.small_agreed`` in its slot
AGREED_FLAG_BYTES = 8


def agreed_here() -> bool:
    """Whether this rank can run ``ShmGroup.small_agreed`` (the compiled small path, built with ``shm_agreed``)."""
    return _ringloop is not None and COMPILED_SMALL and hasattr(_ringloop, "shm_agreed")


def _load_futex() -> tuple[Callable[[int, int, float], None], Callable[[int], None]] | None:
    """(wait(addr, expected, timeout_s), wake(addr)) on a shared futex, or None where unavailable."""
    import ctypes
    import platform

    number = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
    if number is None or not sys.platform.startswith("linux"):
        return None
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long

    class Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    futex_wait, futex_wake, c_void_p, c_int, byref = 0, 1, ctypes.c_void_p, ctypes.c_int, ctypes.byref

    def wait(addr: int, expected: int, timeout_s: float) -> None:
        low = expected & 0xFFFFFFFF
        ts = Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
        syscall(number, c_void_p(addr), futex_wait, c_int(low - (1 << 32) if low >= 1 << 31 else low), byref(ts),
                None, 0)

    def wake(addr: int) -> None:
        syscall(number, c_void_p(addr), futex_wake, c_int(0x7FFFFFFF), None, None, 0)

    return wait, wake


_FUTEX = _load_futex() if os.environ.get("SPARK_HVD_SHM_FUTEX", "1") != "0" else None


#: Map the segments with their pages faulted in at set-up (MAP_POPULATE) rather than on first touch during the
#: first collectives: otherwise every rank takes a page fault per 4 KiB of every member's slots until each slot has
#: been used once, which made the first ~64 MiB of collectives up to twice as slow.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def shm_available() -> bool:
    """Whether the shared-memory transport can be used here: Linux with a writable /dev/shm, on x86 (whose
    stores become visible in program order, which the flag protocol relies on; other CPUs use TCP)."""
    import platform

    return (platform.machine().lower() in ("x86_64", "amd64", "i686", "i386") and os.path.isdir(SHM_DIR)
            and os.access(SHM_DIR, os.W_OK))


def segment_path(job_id: str, nonce: str, rank: int) -> str:
    """The name of ``rank``'s segment: the job id plus a nonce agreed at the rendezvous (so every rank of the
    job knows every name and can remove a dead peer's segment)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", job_id)[:40] or "job"
    return os.path.join(SHM_DIR, f"spark_hvd-{safe}-{re.sub(r'[^0-9a-f]', '', nonce)[:16]}-{rank}")


def new_nonce() -> str:
    return secrets.token_hex(4)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _block_pieces(segs: Sequence[np.ndarray], block: int) -> list[list[tuple[np.ndarray, int]]]:
    """Cut the concatenation of the flat arrays ``segs`` into blocks of ``block`` elements: for every block, the
    pieces that make it up, as (view of one array, offset of the piece in the block)."""
    blocks: list[list[tuple[np.ndarray, int]]] = []
    room = 0
    for seg in segs:
        pos, n = 0, seg.size
        while pos < n:
            if room == 0:
                blocks.append([])
                room = block
            take = min(room, n - pos)
            blocks[-1].append((seg[pos:pos + take], block - room))
            pos += take
            room -= take
    return blocks


class ShmGroup:
    """Shared-memory staging and synchronisation among ``size`` ranks of one host.

    ``local`` is this rank's index in the group, ``ranks`` the job ranks of the group (for error messages).
    ``paths`` are the members' segment names (``segment_path``). Create it on every member (which creates this
    rank's segment), wait until all did, ``attach``, wait until all did, ``unlink``.
    """

    def __init__(self, paths: Sequence[str], local: int, ranks: Sequence[int], timeout_s: float,
                 block_bytes: int = 1 << 20, nslots: int = 16) -> None:
        self.local = local
        self.ranks = list(ranks)
        self.size = len(self.ranks)
        self.timeout_s = timeout_s
        self.block_bytes = block_bytes - block_bytes % 64
        self.nslots = nslots
        #: blocks up to this many bytes are reduced in full by every rank (one synchronisation less)
        self.small_bytes = min(SMALL_BLOCK, self.block_bytes // 4)
        self.seq = 0
        #: set to a dict to accumulate seconds spent in "copy_in", "finish" and "wait" (profiling)
        self.profile: dict[str, float] | None = None
        self.path = paths[local]
        self._bytes = CTRL_BYTES + self.nslots * self.block_bytes
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, self._bytes)
            self._own = mmap.mmap(fd, self._bytes, flags=_MAP_FLAGS)
        except BaseException:
            os.close(fd)
            unlink_quietly(self.path)
            raise
        os.close(fd)
        self._maps: list[mmap.mmap] = []
        self.ctrl: list[memoryview] = []
        #: restores the creating thread's CPUs at ``close`` (``shm_bind``: set by whoever bound it)
        self.unbind: Callable[[], None] | None = None
        self.slots: list[np.ndarray] = []
        self.paths = list(paths)
        self._addr: list[int] = []
        # spinning only helps when every member can run at once; with more ranks than cores it steals the CPU
        # from the very peer being waited for, so sleep on the futex straight away
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.spin_checks = SPIN_CHECKS if len(self.ranks) <= cores else 0
        self.small_spin_ns = int(SMALL_SPIN_S * 1e9) if self.spin_checks else 0
        #: the compiled small path's view of the group (``_ringloop.shm_small``), set by ``attach``; None: Python
        self.layout: bytes | None = None
        self._codes: dict[tuple[np.dtype, ReduceOp, bool], tuple[int, int] | None] = {}
        own = memoryview(self._own)[:CTRL_BYTES].cast("q")
        own[PID] = os.getpid()
        own[PID + 1] = np.frombuffer(self._own, dtype=np.uint8, count=8).ctypes.data  # for shm_cma.probe
        own.release()

    def attach(self) -> None:
        """Map every member's segment (read-only for peers); every member must have created its own."""
        for k, path in enumerate(self.paths):
            if k == self.local:
                m = self._own
            else:
                fd = os.open(path, os.O_RDONLY)
                try:
                    m = mmap.mmap(fd, self._bytes, flags=_MAP_FLAGS, prot=mmap.PROT_READ)
                finally:
                    os.close(fd)
                self._maps.append(m)
            self.ctrl.append(memoryview(m)[:CTRL_BYTES].cast("q"))
            self._addr.append(np.frombuffer(m, dtype=np.uint8, count=CTRL_BYTES).ctypes.data)
            self.slots.append(np.frombuffer(m, dtype=np.uint8, count=self.nslots * self.block_bytes,
                                            offset=CTRL_BYTES))
        if _ringloop is not None and COMPILED_SMALL:
            self.layout = np.array([self.size, self.local, self.nslots, self.block_bytes, *self._addr,
                                    *(s.ctypes.data for s in self.slots)], np.int64).tobytes()

    def unlink(self) -> None:
        """Remove every member's name from /dev/shm (the mappings stay valid)."""
        unlink_quietly(self.path)
        for path in self.paths:
            unlink_quietly(path)

    def close(self) -> None:
        """Unmap everything (and unlink, in case that had not happened yet)."""
        self.unlink()
        self.layout = None
        if self.unbind is not None:
            self.unbind, unbind = None, self.unbind
            unbind()
        for view in self.ctrl:
            view.release()
        self.ctrl = []
        self.slots = []
        for m in [*self._maps, self._own]:
            try:
                m.close()
            except BufferError:  # a caller still holds a view; the mapping goes with the last reference
                pass
        self._maps = []

    # -- synchronisation ---------------------------------------------------------------------------------------
    def _publish(self, word: int, value: int) -> None:
        """Store ``value`` in this rank's control ``word`` and wake peers sleeping on it."""
        self.ctrl[self.local][word] = value
        if _FUTEX is not None:
            _FUTEX[1](self._addr[self.local] + 8 * word)

    def _wait(self, k: int, word: int, target: int, operation: str, check_peers: Callable[[str], None],
              idle: Callable[[], bool] | None = None) -> None:
        if self.profile is None:
            return self._wait_for(k, word, target, operation, check_peers, idle)
        t0 = time.perf_counter()
        try:
            return self._wait_for(k, word, target, operation, check_peers, idle)
        finally:
            self.profile["wait"] = self.profile.get("wait", 0.0) + time.perf_counter() - t0

    def _wait_for(self, k: int, word: int, target: int, operation: str, check_peers: Callable[[str], None],
                  idle: Callable[[], bool] | None) -> None:
        """Wait until rank k's ``word`` >= ``target``: useful ``idle`` work first, a short spin, then sleep on a
        futex (or poll with short sleeps), checking peers every 2 ms and giving up after the timeout."""
        ctrl = self.ctrl[k]
        while idle is not None and ctrl[word] < target:
            if not idle():
                break
        for _ in range(self.spin_checks):
            if ctrl[word] >= target:
                return
        start = time.monotonic()
        next_check = start
        delay = 20e-6
        addr = self._addr[k] + 8 * word
        own = self.ctrl[self.local]
        own[SLEEP] = 1 + k * (CTRL_BYTES // 8) + word  # a compiled publisher wakes only a rank that says it sleeps
        try:
            while True:
                value = ctrl[word]
                if value >= target:
                    return
                if _FUTEX is not None:
                    _FUTEX[0](addr, value, 0.002)
                else:
                    time.sleep(delay)
                    delay = min(delay * 1.5, 0.001)
                now = time.monotonic()
                if now >= next_check:
                    try:
                        check_peers(operation)
                    except PeerFailureError:
                        if ctrl[word] >= target:  # it finished its part (and left) after our last look
                            return
                        raise
                    if now - start > self.timeout_s:
                        rank = self.ranks[k]
                        raise CollectiveTimeoutError(
                            f"{operation}: rank {rank} did not take part within {self.timeout_s:.0f}s "
                            "(SPARK_HVD_TIMEOUT); it is stuck or called another collective", rank=rank,
                            operation=operation)
                    next_check = now + 0.002
        finally:
            own[SLEEP] = 0

    def _wait_all(self, word: int, target: int, operation: str, check_peers: Callable[[str], None],
                  idle: Callable[[], bool] | None = None) -> None:
        for k in range(self.size):
            if k != self.local and self.ctrl[k][word] < target:
                self._wait(k, word, target, operation, check_peers, idle)

    def _ready_all(self, word: int, target: int) -> bool:
        return all(self.ctrl[k][word] >= target for k in range(self.size) if k != self.local)

    def release(self) -> None:
        """After a barrier's collective: spin until every peer has finished it too (its ``OUT`` reached this
        rank's), for at most ``RELEASE_SPIN_S``, so that the ranks leave the barrier together.

        A rank that waited long in the collective went to sleep on the futex, and the last rank to arrive, which
        finds every ``IN`` already there, would leave a whole wake-up (30-150 us on a loaded host) before it: the
        collective after the barrier then starts that far apart, and its early rank pays the gap and a wake-up of
        its own (``benchmarks/allreduce.py --after-barrier``). Spinning here is cheap, since every peer is known to
        have arrived and only has to wake; after ``RELEASE_YIELD_S`` each look yields the core first, since the
        scheduler may have woken the peer onto this one. It moves no counter and fails nothing: a peer still not
        done after the bound has been preempted, and the caller goes on as before. No spin where ranks outnumber
        the cores (``spin_checks`` 0)."""
        if self.size == 1 or not self.spin_checks:
            return
        if self.layout is not None:
            _ringloop.shm_release(self.layout, self.seq, int(RELEASE_SPIN_S * 1e9), int(RELEASE_YIELD_S * 1e9),
                                  MOVE_OFF_PEER)
            return
        target, me = self.seq, self.local
        clock = time.perf_counter
        start = 0.0
        for k in range(self.size):
            if k == me:
                continue
            ctrl = self.ctrl[k]
            while ctrl[OUT] < target:
                now = clock()
                if not start:
                    start = now
                elif now - start > RELEASE_SPIN_S:
                    return
                elif now - start > RELEASE_YIELD_S:
                    os.sched_yield()  # the peer may wait for this very core

    def barrier(self, operation: str, check_peers: Callable[[str], None]) -> None:
        """Return once every member has called it, and leave with them (``release``): one small collective."""
        self._allreduce_small(np.zeros(1, np.uint8), ReduceOp.MAX, False, operation, check_peers)
        self.release()

    # -- exchange rounds (the slice collectives of ``shm_slices``) ----------------------------------------------
    def rounds(self, nblocks: int, stage: Callable[[int, np.ndarray], None],
               consume: Callable[[int, int, np.ndarray], None], operation: str,
               check_peers: Callable[[str], None]) -> None:
        """Run ``nblocks`` exchange rounds among the members, one slot each, under the counter protocol above.

        Round ``b``: ``stage(b, slot)`` fills this rank's slot (uint8, ``block_bytes``) with what its peers need
        from it, then ``IN`` is published; for every peer k, in the fixed order ``me + 1, me + 2, ...`` (so a
        reduction adds in the same order every time), once k's ``IN`` covers the round, ``consume(b, k, slot_k)``
        reads k's slot (read-only); then ``OUT``. Later rounds are staged while waiting (copy overlaps the wait).
        """
        if nblocks <= 0 or self.size == 1:
            return
        base = self.seq
        self.seq += nblocks
        me, nslots, block = self.local, self.nslots, self.block_bytes
        staged = 0

        def stage_next() -> None:
            nonlocal staged
            g = base + staged + 1
            if g > nslots:
                self._wait_all(OUT, g - nslots, operation, check_peers)
            off = ((g - 1) % nslots) * block
            stage(staged, self.slots[me][off:off + block])
            self._publish(IN, g)
            staged += 1

        def stage_ahead() -> bool:
            """Idle work while waiting: stage the next round if its slot is free (never waits)."""
            if staged >= nblocks:
                return False
            g = base + staged + 1
            if g > nslots and not self._ready_all(OUT, g - nslots):
                return False
            stage_next()
            return True

        for b in range(nblocks):
            while staged <= b:
                stage_next()
            g = base + b + 1
            off = ((g - 1) % nslots) * block
            for step in range(1, self.size):
                k = (me + step) % self.size
                if self.ctrl[k][IN] < g:
                    self._wait(k, IN, g, operation, check_peers, stage_ahead)
                consume(b, k, self.slots[k][off:off + block])
            self._publish(OUT, g)

    # -- broadcast ---------------------------------------------------------------------------------------------
    def broadcast(self, segs: Sequence[np.ndarray], root: int, operation: str,
                  check_peers: Callable[[str], None]) -> None:
        """Overwrite the flat arrays ``segs`` with those of group member ``root``, block by block.

        The root copies each block into its slot and publishes ``IN`` and ``OUT``; the others copy it out and
        publish ``OUT`` (which frees the slot for the root's next round of blocks).
        """
        segs = [s for s in segs if s.size]
        if not segs or self.size == 1:
            return
        block = self.block_bytes
        plan = _block_pieces([s.view(np.uint8) for s in segs], block)
        nblocks = len(plan)
        base = self.seq
        self.seq += nblocks
        me = self.local
        slot_area = self.slots[root]
        for b in range(nblocks):
            g = base + b + 1
            off = ((g - 1) % self.nslots) * block
            if me == root:
                if g > self.nslots:
                    self._wait_all(OUT, g - self.nslots, operation, check_peers)
            elif self.ctrl[root][IN] < g:
                self._wait(root, IN, g, operation, check_peers)
            for mine, at in plan[b]:
                theirs = slot_area[off + at:off + at + mine.size]
                if me == root:
                    theirs[...] = mine  # slot_area is this rank's own (writable) slot here
                else:
                    mine[...] = theirs
            if me == root:
                self._publish(IN, g)
            self._publish(OUT, g)

    # -- allreduce ----------------------------------------------------------------------------------------------
    def small(self, arr: np.ndarray, op: ReduceOp, bfloat16: bool, operation: str,
              check_peers: Callable[[str], None]) -> None:
        """Allreduce one flat array of at most ``small_bytes`` in place: ``allreduce([arr], ...)`` with less on the
        way (the latency path)."""
        if self.profile is None and arr.size:
            self._allreduce_small(arr, op, bfloat16, operation, check_peers)
        else:
            self.allreduce([arr], op, bfloat16, operation, check_peers)

    def _allreduce_small(self, arr: np.ndarray, op: ReduceOp, bfloat16: bool, operation: str,
                         check_peers: Callable[[str], None]) -> None:
        """One block, one array: the latency path (same protocol as ``allreduce``, less bookkeeping), compiled
        where it was built (``_ringloop.shm_small``: the same steps, no Python between them)."""
        if self.layout is not None and arr.flags.c_contiguous and arr.flags.writeable:
            key = (arr.dtype, op, bfloat16)
            codes = self._codes.get(key, ())
            if codes == ():
                codes = self._codes[key] = _small_codes(*key)
            if codes is not None:
                self._allreduce_small_compiled(arr, codes, operation, check_peers)
                return
        g = self.seq = self.seq + 1
        if g > self.nslots:
            self._wait_all(OUT, g - self.nslots, operation, check_peers)
        off = ((g - 1) % self.nslots) * self.block_bytes
        nbytes = arr.nbytes
        me, size = self.local, self.size
        self.slots[me][off:off + nbytes] = arr.view(np.uint8)
        self._publish(IN, g)
        self._wait_all(IN, g, operation, check_peers)
        dtype = arr.dtype
        slots = [s[off:off + nbytes].view(dtype) for s in self.slots]
        if bfloat16:
            arr[...] = slots[0]
            for k in range(1, size):
                reduce_into(arr, slots[k], op, True)
        elif size == 2:
            ufunc_for(op)(arr, slots[1 - me], out=arr)  # commutative: both ranks get the same bits
        else:
            ufunc = ufunc_for(op)
            ufunc(slots[0], slots[1], out=arr)
            for k in range(2, size):
                ufunc(arr, slots[k], out=arr)
        if op is ReduceOp.AVERAGE:
            divide_average(arr, size, bfloat16)
        self._publish(OUT, g)

    def _allreduce_small_compiled(self, arr: np.ndarray, codes: tuple[int, int], operation: str,
                                  check_peers: Callable[[str], None]) -> None:
        """``_allreduce_small`` in C; a wait longer than ``SMALL_BUDGET_S`` goes on in Python (``_wait_all``: peers
        checked, the timeout), then C again from where it stopped."""
        g = self.seq = self.seq + 1
        stage = 0
        while True:
            stage = _ringloop.shm_small(self.layout, arr, codes[0], codes[1], g, stage, self.small_spin_ns,
                                        _SMALL_YIELD_NS, _SMALL_BUDGET_NS, MOVE_OFF_PEER)
            if not stage:
                return
            stage = self._wait_small(stage, g, operation, check_peers)

    def _wait_small(self, stage: int, g: int, operation: str, check_peers: Callable[[str], None]) -> int:
        """A compiled small call waited its budget (``stage`` 1: for the slot, 3: for the peers' data): the wait
        goes on in Python (peers checked, the timeout); returns the stage to call again from."""
        if stage == 1:
            self._wait_all(OUT, g - self.nslots, operation, check_peers)
            return 0
        self._wait_all(IN, g, operation, check_peers)
        return 2

    def agreed_codes(self, dtype: np.dtype, op: ReduceOp) -> tuple[int, int] | None:
        """The codes ``small_agreed`` takes for ``dtype`` and ``op``, or None where it cannot run them (not built
        here, or a dtype / op the compiled loop lacks; every rank must have ``agreed_here()``, which the backend
        checks for the job). It takes arrays of up to ``small_bytes - AGREED_FLAG_BYTES``."""
        if self.layout is None or not agreed_here():
            return None
        key = (dtype, op, False)
        codes = self._codes.get(key, ())
        if codes == ():
            codes = self._codes[key] = _small_codes(*key)
        return codes

    def small_agreed(self, arr: np.ndarray, agree: bool, codes: tuple[int, int], operation: str,
                     check_peers: Callable[[str], None]) -> bool:
        """One small allreduce carrying the ranks' agreement in band (``_ringloop.shm_agreed``): ``arr`` (C-contiguous,
        writable, at most ``small_bytes - AGREED_FLAG_BYTES``; ``codes`` from ``agreed_codes``) is reduced in place
        only if every rank ``agree``s, which is what it returns; with ``agree`` False ``arr`` is never read or
        written. The same synchronisation as ``small``, the flag ahead of the data in the slot, so a speculative
        round costs one small allreduce and no copy into a staging array."""
        g = self.seq = self.seq + 1
        stage = _ringloop.shm_agreed(self.layout, arr, agree, codes[0], codes[1], g, 0, self.small_spin_ns,
                                     _SMALL_YIELD_NS, _SMALL_BUDGET_NS, MOVE_OFF_PEER)
        while stage != 0 and stage != 4:  # a wait ran past its budget
            stage = self._wait_small(stage, g, operation, check_peers)
            stage = _ringloop.shm_agreed(self.layout, arr, agree, codes[0], codes[1], g, stage, self.small_spin_ns,
                                         _SMALL_YIELD_NS, _SMALL_BUDGET_NS, MOVE_OFF_PEER)
        return stage == 0

    # -- allreduce (general) ------------------------------------------------------------------------------------
    def allreduce(self, segs: Sequence[np.ndarray], op: ReduceOp, bfloat16: bool, operation: str,
                  check_peers: Callable[[str], None]) -> None:
        """Allreduce the concatenation of the flat, contiguous, same-dtype arrays ``segs`` in place."""
        segs = [s for s in segs if s.size]
        if not segs:
            return
        if len(segs) == 1 and segs[0].nbytes <= self.small_bytes and self.profile is None:
            self._allreduce_small(segs[0], op, bfloat16, operation, check_peers)
            return
        _BlockAllreduce(self, segs, op, bfloat16, operation, check_peers).run()


class _BlockAllreduce:
    """One allreduce of ``ShmGroup.allreduce`` as a pipeline of blocks (the module docstring's protocol).

    Block ``b`` (sequence number ``g = base + b + 1``, slot ``(g - 1) % nslots``) is copied in (``copy_in``), then
    finished (``finish``): two ranks reduce straight from the peer's slot (``_finish_pair``), small blocks are
    reduced in full by every rank (``_finish_small``), larger ones reduce-scattered and gathered (``_reduce_chunk``,
    ``_finish_scatter``). While a rank waits it copies later blocks in ahead (``copy_ahead``) and, in scatter mode,
    reduces its chunk of blocks already in (``work_ahead``): ``next_in`` and ``next_red`` count the blocks done so.
    """

    __slots__ = ("group", "segs", "op", "bfloat16", "operation", "check_peers", "itemsize", "total", "block",
                 "nblocks", "size", "me", "nslots", "slots", "ufunc", "average", "halve", "plan", "base", "next_in",
                 "next_red")

    def __init__(self, group: ShmGroup, segs: Sequence[np.ndarray], op: ReduceOp, bfloat16: bool, operation: str,
                 check_peers: Callable[[str], None]) -> None:
        self.group, self.segs, self.op, self.bfloat16 = group, segs, op, bfloat16
        self.operation, self.check_peers = operation, check_peers
        dtype = segs[0].dtype
        self.itemsize = dtype.itemsize
        self.total = sum(s.size for s in segs)
        self.block = group.block_bytes // self.itemsize
        self.nblocks = -(-self.total // self.block)
        self.size, self.me, self.nslots = group.size, group.local, group.nslots
        self.slots = [s.view(dtype) for s in group.slots]
        self.ufunc = ufunc_for(op)
        self.average = op is ReduceOp.AVERAGE
        # two ranks averaging floats: each halves its data on the way into its slot (exact in binary floating
        # point, as halving the sum is) and the result is the sum of the two slots: no pass dividing the sum
        self.halve = self.average and self.size == 2 and not bfloat16 and dtype.kind == "f" and dtype.itemsize >= 4
        # every block's pieces, (view of a segment, offset in the block), worked out once for copy-in and finish
        self.plan = _block_pieces(segs, self.block)
        self.base = group.seq
        group.seq += self.nblocks
        self.next_in = 0  # blocks copied in
        self.next_red = 0  # blocks whose chunk this rank reduced (scatter mode)

    def run(self) -> None:
        prof = self.group.profile
        copy_in, finish = self.copy_in, self.finish
        if prof is not None:
            copy_in, finish = _timed(copy_in, prof, "copy_in"), _timed(finish, prof, "finish")
            prof["blocks"] = prof.get("blocks", 0) + self.nblocks
        for b in range(self.nblocks):
            while self.next_in <= b:  # this block must be in before it is finished (may wait for a free slot)
                copy_in(self.next_in)
                self.next_in += 1
            finish(b)

    # -- copy-in ------------------------------------------------------------------------------------------------
    def copy_in(self, b: int) -> None:
        group, block = self.group, self.block
        g = self.base + b + 1
        if g > self.nslots:
            group._wait_all(OUT, g - self.nslots, self.operation, self.check_peers)
        lo = b * block
        hi = min(self.total, lo + block)
        slot = self.slots[self.me][((g - 1) % self.nslots) * block:][:hi - lo]
        parts = self.plan[b]
        if self.halve:
            for view, at in parts:
                np.multiply(view, 0.5, out=slot[at:at + view.size])
        elif len(parts) == 1:
            slot[...] = parts[0][0]
        else:
            np.concatenate([view for view, _ in parts], out=slot)  # one call, not one per piece
        group._publish(IN, g)

    def copy_ahead(self) -> bool:
        """Idle work while waiting: copy in the next block if its slot is free (never waits)."""
        if self.next_in >= self.nblocks:
            return False
        g = self.base + self.next_in + 1
        if g > self.nslots and not self.group._ready_all(OUT, g - self.nslots):
            return False
        if self.group.profile is not None:
            _timed(self.copy_in, self.group.profile, "copy_in")(self.next_in)
        else:
            self.copy_in(self.next_in)
        self.next_in += 1
        return True

    # -- finish -------------------------------------------------------------------------------------------------
    def finish(self, b: int) -> None:
        if self.size == 2:
            self._finish_pair(b)
        elif (min(self.total, (b + 1) * self.block) - b * self.block) * self.itemsize <= self.group.small_bytes:
            self._finish_small(b)
        else:
            self._finish_scatter(b)

    def _finish_pair(self, b: int) -> None:
        """Two ranks: ``out = mine + peer's slot`` straight into the caller's arrays (commutative: the same bits)."""
        group, op, bfloat16 = self.group, self.op, self.bfloat16
        g = self.base + b + 1
        n = min(self.total, (b + 1) * self.block) - b * self.block
        off = ((g - 1) % self.nslots) * self.block
        peer = 1 - self.me
        if group.ctrl[peer][IN] < g:
            group._wait(peer, IN, g, self.operation, self.check_peers, self.copy_ahead)
        theirs = self.slots[peer][off:off + n]
        if self.halve:
            mine = self.slots[self.me][off:off + n]
            for dst, at in self.plan[b]:
                np.add(mine[at:at + dst.size], theirs[at:at + dst.size], out=dst)
            group._publish(OUT, g)
            return
        for dst, at in self.plan[b]:
            if bfloat16:
                reduce_into(dst, theirs[at:at + dst.size], op, True)
            else:
                self.ufunc(dst, theirs[at:at + dst.size], out=dst)
            if self.average:
                divide_average(dst, 2, bfloat16)
        group._publish(OUT, g)

    def _finish_small(self, b: int) -> None:
        """A small block: every rank reduces every slot in rank order (one synchronisation less, identical bits)."""
        group, op, bfloat16, slots, size, ufunc = self.group, self.op, self.bfloat16, self.slots, self.size, self.ufunc
        g = self.base + b + 1
        off = ((g - 1) % self.nslots) * self.block
        group._wait_all(IN, g, self.operation, self.check_peers, self.copy_ahead)
        for dst, a in self.plan[b]:
            m = dst.size
            if bfloat16:
                dst[...] = slots[0][off + a:off + a + m]
                for k in range(1, size):
                    reduce_into(dst, slots[k][off + a:off + a + m], op, True)
            else:
                ufunc(slots[0][off + a:off + a + m], slots[1][off + a:off + a + m], out=dst)
                for k in range(2, size):
                    ufunc(dst, slots[k][off + a:off + a + m], out=dst)
            if self.average:
                divide_average(dst, size, bfloat16)
        group._publish(OUT, g)

    def _reduce_chunk(self, b: int) -> None:
        """Scatter mode: reduce this rank's chunk of block b over every slot into its own slot."""
        g = self.base + b + 1
        n = min(self.total, (b + 1) * self.block) - b * self.block
        off = ((g - 1) % self.nslots) * self.block
        me, size = self.me, self.size
        c0, c1 = me * n // size, (me + 1) * n // size
        acc = self.slots[me][off + c0:off + c1]
        for k in range(size):
            if k != me:
                reduce_into(acc, self.slots[k][off + c0:off + c1], self.op, self.bfloat16)
        if self.average:
            divide_average(acc, size, self.bfloat16)
        self.group._publish(RED, g)

    def work_ahead(self) -> bool:
        """Idle work in scatter mode: copy in ahead, else reduce the next full block whose data is all in."""
        if self.copy_ahead():
            return True
        if self.next_red < self.next_in and (self.next_red + 1) * self.block <= self.total and \
                self.group._ready_all(IN, self.base + self.next_red + 1):
            self._reduce_chunk(self.next_red)
            self.next_red += 1
            return True
        return False

    def _finish_scatter(self, b: int) -> None:
        """Reduce this rank's chunk into its slot (unless done ahead), then gather every member's chunk."""
        group, slots, size, me = self.group, self.slots, self.size, self.me
        g = self.base + b + 1
        n = min(self.total, (b + 1) * self.block) - b * self.block
        off = ((g - 1) % self.nslots) * self.block
        while self.next_red <= b:
            group._wait_all(IN, self.base + self.next_red + 1, self.operation, self.check_peers, self.copy_ahead)
            self._reduce_chunk(self.next_red)
            self.next_red += 1
        for step in range(size):
            k = (me + step) % size
            if k != me and group.ctrl[k][RED] < g:
                group._wait(k, RED, g, self.operation, self.check_peers, self.work_ahead)
            c0, c1 = k * n // size, (k + 1) * n // size  # member k's chunk of the block
            for dst, at in self.plan[b]:
                a0, a1 = max(at, c0), min(at + dst.size, c1)
                if a0 < a1:
                    dst[a0 - at:a1 - at] = slots[k][off + a0:off + a1]
        group._publish(OUT, g)


def _small_codes(dtype: np.dtype, op: ReduceOp, bfloat16: bool) -> tuple[int, int] | None:
    """The compiled loop's (dtype, op) codes for a small allreduce, or None where it has none (the Python path)."""
    if op not in _OPS:
        return None
    if bfloat16:
        return (_BF16, _OPS[op]) if dtype == np.uint16 else None
    code = _DTYPES.get(dtype)
    return None if code is None else (code, _OPS[op])


def _timed(fn: Callable[[int], None], prof: dict[str, float], key: str) -> Callable[[int], None]:
    """``fn`` adding its seconds to ``prof[key]`` (``ShmGroup.profile``)."""
    def run(b: int) -> None:
        t0 = time.perf_counter()
        fn(b)
        prof[key] = prof.get(key, 0.0) + time.perf_counter() - t0
    return run
