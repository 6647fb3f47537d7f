"""Single-copy allreduce between the two ranks of one host, by cross-memory attach (Linux ``process_vm_readv``).

The slot protocol of ``shm.py`` copies every byte into shared memory and back out: per rank about 3S read and 2S
written for an array of S bytes. Here each rank reads its peer's *user buffer* directly (the kernel copies from
the peer's pages, as Open MPI's CMA transport does): per rank about 2S read and 1.5S written, S/2 of the writes
into a scratch that stays in cache.

The two ranks share the control pages of their ``ShmGroup`` and its counter protocol (monotonic counters, one
cache line each, published with a plain store after the data they cover; x86 keeps stores in order). Operation
``t`` (counted from 1 on both ranks) allreduces the concatenation of the flat arrays ``segs`` (same dtype, same
total length on both ranks); the array is split in two halves, rank ``r`` of the pair owning half ``r``:

1. post: write the address and length of every array into the control page, then ``POSTED = t``;
2. reduce-scatter: once the peer's ``POSTED >= t``, read the peer's part of half r block by block
   (``block_bytes``, cache-sized) into a preallocated scratch and reduce it into this rank's half r in place
   (AVERAGE divides there too; where the compiled loop was built, all the blocks in one call without the GIL,
   ``_ringloop.cma_reduce``, the same bits); then ``HALF = t``;
3. allgather: once the peer's ``HALF >= t``, read the peer's (reduced) half 1-r straight into this rank's
   half 1-r; then ``DONE = t``;
4. wait until the peer's ``DONE >= t``, and return.

A reducescatter (``CmaPair.reducescatter``) is step 2 alone, into a separate output (each rank reads the peer's
elements of its own slice from the peer's unchanged input, then ``HALF``, ``DONE``), an allgather
(``CmaPair.allgather``) step 3 alone (each rank reads the peer's piece straight into its own output): one
operation ``t`` each, under the same rules.

Ordering rules (``tests/core/test_shm_cma.py`` runs them with tiny blocks and many blocks):

* A rank never overwrites a region its peer may still read. During step 2 the peer reads this rank's half 1-r
  (untouched until step 3) and this rank writes only its half r; step 3 writes half 1-r only after the peer's
  ``HALF >= t``, i.e. after the peer has read all of it; the peer reads this rank's half r in its step 3 only
  after this rank's ``HALF = t``, i.e. once it is final.
* A rank does not return (after which the caller may free or reuse its buffer) before the peer's ``DONE >= t``:
  the peer has finished every read of this operation. The table of addresses of operation ``t + 1`` is written
  only after that too, so a peer never reads a stale address.
* Every element is reduced once, by the half's owner, and copied to the other rank: both ranks hold identical
  bits for every op (bfloat16 is widened and rounded by ``reduce_into`` as elsewhere).

Every wait is the ``ShmGroup`` wait: the timeout and the peer-liveness check, naming the rank. A read that fails
(``ESRCH``: the peer process is gone; ``EFAULT``: its buffer is no longer mapped) raises ``PeerFailureError``
naming the peer.

Trust: ``process_vm_readv`` needs the same uid (and ptrace permission, which Yama's ``ptrace_scope`` may refuse:
``probe`` tries one read at set-up and the caller falls back to the slot protocol). The ranks of a job already
map each other's shared-memory segments and share the job's secret, which authenticates every frame they
exchange; a rank that can read its peer's memory learns nothing it could not already receive as a job member,
and this code reads only the ranges its peer published for the current operation. A process of the same uid
outside the job could read the ranks' memory with or without this module (that is what the uid boundary means).
Where the two ranks share /dev/shm but not a PID namespace (two containers), the published pid names no process
or another one: the probe reads the peer's own control page and checks that it holds that pid, so a wrong
process is never read from (both ranks keep the slot protocol). A peer that dies mid-operation frees its pid: a
read fails with ``ESRCH`` unless the kernel gave the pid to a new process within the few milliseconds before the
liveness check notices, in which case bytes of that process may land in this rank's buffer of an operation that
fails anyway.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import os
import sys
from collections.abc import Callable, Sequence

import numpy as np

from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.errors import PeerFailureError, TensorMismatchError
from spark_hvd.core.reduce import divide_average, reduce_into
from spark_hvd.core.transport import shm
from spark_hvd.core.transport.shm import CTRL_BYTES, PID, ShmGroup

# control words (int64 index into the control page) after ``shm``'s IN, RED, OUT, PID; one cache line each
POSTED, HALF, DONE, NSEG = 32, 40, 48, 56
#: the table of posted arrays, (address, bytes) per array, fills the rest of the control page
TABLE = 64
#: at most this many arrays in one operation (more: the caller uses the slot protocol)
MAX_SEGS = (CTRL_BYTES // 8 - TABLE) // 2
#: scratch block of the reduce-scatter: the peer's data is read into it and reduced from it while in cache
BLOCK_BYTES = 512 * 1024
#: the allgather reads at most this many bytes per call (Linux moves at most ~2 GiB per process_vm_readv)
READ_BYTES = 256 << 20
#: the reduce-scatter's compiled loop (``_ringloop.cma_reduce``: every block's read and its reductions piece by
#: piece, without Python between them or the GIL), where it was built; False: the Python loop (the same bits; tests)
COMPILED = True
_CMA_REDUCE = getattr(shm._ringloop, "cma_reduce", None)


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _load_readv() -> Callable[..., int] | None:
    """libc's ``process_vm_readv``, or None where there is none (not Linux, no such symbol)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):
        return None
    iov_p = ctypes.POINTER(_IoVec)
    fn.argtypes = [ctypes.c_int, iov_p, ctypes.c_ulong, iov_p, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return fn


_READV = _load_readv()


def _spans(starts: Sequence[int], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """The pieces of the range [lo, hi) of a concatenation whose parts begin at ``starts`` (with the total
    appended): (part, offset in the part, length), in order."""
    out = []
    i = bisect.bisect_right(starts, lo) - 1
    while lo < hi:
        end = min(hi, starts[i + 1])
        if end > lo:
            out.append((i, lo - starts[i], end - lo))
        lo = end
        i += 1
    return out


def _offsets(lengths: Sequence[int]) -> list[int]:
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return starts


def _readv(pid: int, liov: ctypes.Array, nl: int, riov: ctypes.Array, nr: int, want: int, rank: int,
           operation: str) -> None:
    """One ``process_vm_readv`` of ``want`` bytes; a failure raises ``PeerFailureError`` naming ``rank``."""
    if _READV is None:
        raise PeerFailureError(f"{operation}: process_vm_readv is not available here", rank=rank,
                               operation=operation)
    got = _READV(pid, liov, nl, riov, nr, 0)
    if got != want:
        _fail(pid, got, want, ctypes.get_errno() if got < 0 else 0, rank, operation)


def _fail(pid: int, got: int, want: int, err: int, rank: int, operation: str) -> None:
    """Raise the ``PeerFailureError`` of a read of ``want`` bytes that returned ``got`` with ``errno`` ``err``."""
    why = {errno.ESRCH: "its process is gone", errno.EFAULT: "its buffer is no longer mapped",
           errno.EPERM: "permission denied"}.get(err, os.strerror(err) if err else f"only {got} of {want} bytes")
    raise PeerFailureError(f"{operation}: could not read the memory of rank {rank} (pid {pid}): {why}", rank=rank,
                           operation=operation)


def read_peer(pid: int, local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]], rank: int,
              operation: str) -> None:
    """Copy the (address, bytes) ranges ``remote`` of process ``pid`` into this process's ``local`` ranges (the
    same number of bytes in all); a failure raises ``PeerFailureError`` naming ``rank``."""
    liov = (_IoVec * len(local))(*[_IoVec(a, n) for a, n in local])
    riov = (_IoVec * len(remote))(*[_IoVec(a, n) for a, n in remote])
    _readv(pid, liov, len(local), riov, len(remote), sum(n for _, n in local), rank, operation)


def probe(group: ShmGroup) -> str | None:
    """Try one cross-memory read of the peer's control page (its own mapping, at the address it published at
    ``PID + 1``); None when it works, else the reason (the caller then keeps the slot protocol)."""
    if _READV is None:
        return "process_vm_readv is not available"
    peer = 1 - group.local
    pid, addr = int(group.ctrl[peer][PID]), int(group.ctrl[peer][PID + 1])
    word = np.zeros(1, np.int64)
    try:
        read_peer(pid, [(word.ctypes.data, 8)], [(addr + 8 * PID, 8)], group.ranks[peer], "setup")
    except PeerFailureError as exc:
        return str(exc)
    return None if int(word[0]) == pid else "cross-memory read returned wrong data"


class CmaPair:
    """The single-copy allreduce of two ranks over the control pages of a two-member ``ShmGroup`` (see the
    module docstring). Arrays of at least ``min_bytes`` in at most ``MAX_SEGS`` pieces go this way (``takes``)."""

    def __init__(self, group: ShmGroup, min_bytes: int, block_bytes: int = BLOCK_BYTES) -> None:
        if group.size != 2:
            raise ValueError(f"cross-memory allreduce needs a group of 2 ranks, got {group.size}")
        self.group = group
        self.min_bytes = min_bytes
        self.peer = 1 - group.local
        self.peer_rank = group.ranks[self.peer]
        self.peer_pid = int(group.ctrl[self.peer][PID])
        self.block_bytes = max(64, block_bytes - block_bytes % 64)
        self.scratch = np.empty(self.block_bytes, np.uint8)
        self.seq = 0
        # preallocated iovecs (a ctypes array per call costs more than a block's copy is worth)
        self._liov = (_IoVec * (MAX_SEGS + 1))()
        self._riov = (_IoVec * (MAX_SEGS + 1))()

    def _read(self, local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]], operation: str) -> None:
        """``read_peer`` from the peer through the preallocated iovecs."""
        liov, riov = self._liov, self._riov
        for k, (a, n) in enumerate(local):
            liov[k].iov_base, liov[k].iov_len = a, n
        want = 0
        for k, (a, n) in enumerate(remote):
            riov[k].iov_base, riov[k].iov_len = a, n
            want += n
        _readv(self.peer_pid, liov, len(local), riov, len(remote), want, self.peer_rank, operation)

    def takes(self, segs: Sequence[np.ndarray]) -> bool:
        """Whether ``allreduce`` handles these arrays (large enough, not too many pieces)."""
        return 0 < len(segs) <= MAX_SEGS and sum(s.nbytes for s in segs) >= self.min_bytes

    def _post(self, segs: Sequence[np.ndarray], t: int) -> None:
        ctrl = self.group.ctrl[self.group.local]
        ctrl[NSEG] = len(segs)
        for i, s in enumerate(segs):
            ctrl[TABLE + 2 * i] = s.ctypes.data
            ctrl[TABLE + 2 * i + 1] = s.nbytes
        self.group._publish(POSTED, t)

    def _peer_table(self, nbytes: int, operation: str) -> tuple[list[int], list[int]]:
        """The peer's posted (addresses, byte offsets); its total must match this rank's."""
        ctrl = self.group.ctrl[self.peer]
        n = int(ctrl[NSEG])
        if not 0 < n <= MAX_SEGS:
            raise TensorMismatchError(f"{operation}: rank {self.peer_rank} posted {n} arrays (at most {MAX_SEGS})")
        addrs = [int(ctrl[TABLE + 2 * i]) for i in range(n)]
        starts = _offsets([int(ctrl[TABLE + 2 * i + 1]) for i in range(n)])
        if starts[-1] != nbytes:
            raise TensorMismatchError(f"{operation}: rank {self.peer_rank} allreduces {starts[-1]} bytes, rank "
                                      f"{self.group.ranks[self.group.local]} {nbytes}")
        return addrs, starts

    def allreduce(self, segs: Sequence[np.ndarray], op: ReduceOp, bfloat16: bool, operation: str,
                  check_peers: Callable[[str], None]) -> None:
        """Allreduce the concatenation of the flat, contiguous, same-dtype arrays ``segs`` in place."""
        group, me, peer = self.group, self.group.local, self.peer
        dtype = segs[0].dtype
        size = dtype.itemsize
        mine = _offsets([s.nbytes for s in segs])
        total = mine[-1]
        t = self.seq = self.seq + 1
        self._post(segs, t)
        group._wait(peer, POSTED, t, operation, check_peers)
        addrs, theirs = self._peer_table(total, operation)
        half = total // size // 2 * size
        bounds = (0, half, total)
        raw = [s.view(np.uint8) for s in segs]

        def remote(lo: int, hi: int) -> list[tuple[int, int]]:
            return [(addrs[i] + at, n) for i, at, n in _spans(theirs, lo, hi)]

        # reduce-scatter: the peer's part of my half, block by block through the scratch
        lo, hi = bounds[me], bounds[me + 1]
        block = self.block_bytes - self.block_bytes % size
        scratch = self.scratch
        base = scratch.ctypes.data
        average = op is ReduceOp.AVERAGE
        codes = shm._small_codes(dtype, op, bfloat16) if COMPILED and _CMA_REDUCE is not None else None
        if codes is not None:  # the loop below in C: the tables are the control pages' own
            err, got, want = _CMA_REDUCE(self.peer_pid, group.ctrl[me][TABLE:TABLE + 2 * len(segs)],
                                         group.ctrl[peer][TABLE:TABLE + 2 * len(addrs)], scratch[:block], lo, hi,
                                         *codes, 2 if average else 1)
            if err or got != want:
                _fail(self.peer_pid, got, want, err, self.peer_rank, operation)
        else:
            for a in range(lo, hi, block):
                b = min(hi, a + block)
                self._read([(base, b - a)], remote(a, b), operation)
                for i, at, n in _spans(mine, a, b):
                    dst = raw[i][at:at + n].view(dtype)
                    src = scratch[at + mine[i] - a:at + mine[i] - a + n].view(dtype)
                    reduce_into(dst, src, op, bfloat16)
                    if average:
                        divide_average(dst, 2, bfloat16)
        group._publish(HALF, t)
        # allgather: the peer's reduced half straight into mine
        group._wait(peer, HALF, t, operation, check_peers)
        lo, hi = bounds[peer], bounds[peer + 1]
        step = max(size, READ_BYTES - READ_BYTES % size)
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            self._read([(raw[i].ctypes.data + at, n) for i, at, n in _spans(mine, a, b)], remote(a, b), operation)
        group._publish(DONE, t)
        # the peer may still be reading my buffer: only its DONE lets the caller have it back
        group._wait(peer, DONE, t, operation, check_peers)

    def reducescatter(self, flat: np.ndarray, out: np.ndarray, lo: int, op: ReduceOp, bfloat16: bool, operation: str,
                      check_peers: Callable[[str], None]) -> None:
        """``out`` = ``flat[lo:lo + out.size]`` op the peer's same elements (AVERAGE sums: divide afterwards),
        read block by block straight from the peer's ``flat`` (which both ranks post and only read); the
        allreduce's step 2 into a separate output, without its step 3. The peer's ``lo`` may differ (ragged
        slices): each rank reads only the range it reduces."""
        group, peer = self.group, self.peer
        size = flat.dtype.itemsize
        t = self.seq = self.seq + 1
        self._post([flat], t)
        group._wait(peer, POSTED, t, operation, check_peers)
        addr = self._peer_table(flat.nbytes, operation)[0][0]
        block = max(size, self.block_bytes - self.block_bytes % size)
        scratch, base, mine = self.scratch, self.scratch.ctypes.data, flat.view(np.uint8)
        at, stop = lo * size, (lo + out.size) * size
        dst = out.view(np.uint8)
        for a in range(at, stop, block):
            b = min(stop, a + block)
            self._read([(base, b - a)], [(addr + a, b - a)], operation)
            dst[a - at:b - at] = mine[a:b]
            reduce_into(dst[a - at:b - at].view(out.dtype), scratch[:b - a].view(out.dtype), op, bfloat16)
        group._publish(HALF, t)
        group._publish(DONE, t)
        group._wait(peer, DONE, t, operation, check_peers)  # the peer may still be reading my ``flat``

    def allgather(self, raw: np.ndarray, bounds: Sequence[int], operation: str,
                  check_peers: Callable[[str], None]) -> None:
        """Rank r of the pair holds bytes ``bounds[r]:bounds[r + 1]`` of ``raw`` (uint8, as long on both ranks);
        afterwards both hold all: each reads the peer's piece straight from the peer's ``raw`` into its own."""
        group, peer = self.group, self.peer
        t = self.seq = self.seq + 1
        self._post([raw], t)
        group._wait(peer, POSTED, t, operation, check_peers)
        addr = self._peer_table(raw.nbytes, operation)[0][0]
        lo, hi = bounds[peer], bounds[peer + 1]
        for a in range(lo, hi, READ_BYTES):
            b = min(hi, a + READ_BYTES)
            self._read([(raw[a:b].ctypes.data, b - a)], [(addr + a, b - a)], operation)
        group._publish(HALF, t)
        group._publish(DONE, t)
        group._wait(peer, DONE, t, operation, check_peers)  # the peer may still be reading my piece


__all__ = ["CmaPair", "MAX_SEGS", "probe", "read_peer"]
