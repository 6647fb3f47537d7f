"""The built-in ring backend: collectives over an authenticated TCP mesh, and shared memory within a host.

``RingBackend`` joins the job with one ``rendezvous.exchange`` (publishing its listening address, its host
identity and, when shared memory is on, the name of its shared-memory segment), connects a full TCP mesh (every
frame HMAC-authenticated) and then:

* allreduce, by the job's plan (``ring_plans``: chosen once from the topology, a typed object, not a name):
  ``ShmHost`` when every rank is on this host and ``settings.shm`` is on: a pipelined
  shared-memory allreduce (``spark_hvd.core.transport.shm``; two ranks and large arrays: a single-copy one by
  cross-memory attach, ``shm_cma``); ``Hierarchical`` when ranks share hosts across several hosts:
  shared memory within each host, the TCP ring between the host leaders (local rank 0), then a shared-memory
  broadcast within each host (with as many ranks on every host and arrays from ``HIER_SPLIT_BYTES``: a
  shared-memory reduce-scatter leaves slice i reduced over the host on local rank i, which carries it across
  hosts, then one shared-memory allgather; ``shm_slices``; large arrays in pieces, the shared-memory legs
  overlapping the TCP one: ``hier_pipeline``);
  ``TcpRing`` otherwise (one rank per host, or ``SPARK_HVD_SHM=0``): the bandwidth-optimal TCP ring
  (reduce-scatter then allgather, N-1 steps each, pipelined in sub-chunks: each is received, reduced in place
  from a preallocated scratch frame and forwarded at once, in one thread over non-blocking sockets); between two
  ranks, arrays up to ``PAIR_EXCHANGE_BYTES`` are exchanged whole instead (one round trip);
* allgather / reducescatter: the ring's allgather / reduce-scatter half (N-1 steps) over TCP, the slots' slice
  collectives (``shm_slices``) on one host's shared memory (``plan.allgather``, ``plan.reducescatter``);
  broadcast: shared memory when all ranks are local, else root to every rank over TCP; alltoall: pairwise.

A failure (a peer's connection closing, a timeout, a frame failing its HMAC) marks the backend broken, tells every
peer which rank failed (ABORT frames), and raises ``PeerFailureError`` naming that rank; so every rank of the job
fails within the timeout naming the same culprit.

Why this module is long (~700 lines): the job's setup and every collective over TCP share one backend's state
(mesh, topology, scratch); which transport runs an allreduce is the plan's (``ring_plans``), the framing and the
ring's transfer loop are in ``transport/tcp/``, the shared-memory protocol in ``transport/shm.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from spark_hvd.core.algorithms import agreed, halving_doubling, hier_pipeline, recursive_doubling
from spark_hvd.core.backend import Backend, ReduceOp, Rendezvous, alltoall_args
from spark_hvd.core.backends import ring_plans
from spark_hvd.core.backends.ring_plans import Plan, Solo, TcpRing, even_bounds
from spark_hvd.core.errors import (
    AuthenticationError,
    PeerFailureError,
    ShutdownError,
    TensorMismatchError,
)
from spark_hvd.core.jobenv import JobEnv, topology
from spark_hvd.core.reduce import check_dtype, divide_average, reduce_into
from spark_hvd.core.settings import Settings
from spark_hvd.core.transport import ringloop, shm_cma, tcp
from spark_hvd.core.transport.addresses import (  # noqa: F401 - IFACE_ENV, HOST_ID_ENV, host_identity: re-exported
    HOST_ID_ENV,
    IFACE_ENV,
    check_reachable,
    host_identity,
    listen_address,
    machine_identity,
    meeting_host,
)
from spark_hvd.core.transport.shm import AGREED_FLAG_BYTES, ShmGroup, new_nonce, shm_available
from spark_hvd.core.transport.shm import agreed_here as shm_agreed_here
from spark_hvd.core.transport.tcp import (
    FRAME_BYTES,
    INLINE_SEND_BYTES,
    SPIN_MAX_BYTES,
    SUB_CHUNK_MIN_BYTES,
    SUB_CHUNKS,
    PeerAbort,
    PeerSocket,
    PeerWatcher,
    ProtocolError,
    RingExchange,
    SendWorker,
    connect_mesh,
    open_listener,
)
from spark_hvd.core.transport.wire import check_encryption

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

#: A ring over several arrays where they lie (``RingBackend._ring``'s ``segments``) never lets a frame cross an end of
#: an array this large: the frames across the smaller ones between are copied (gathered to send, scattered from the
#: scratch frame), an extra frame costs a few microseconds where a 64 KiB copy costs about as much.
SEGMENT_CUT_BYTES = 64 * 1024

#: Two-rank TCP allreduces up to this size exchange whole arrays (``RingBackend._pair_exchange``): one round trip
#: instead of the ring's two; above it the ring's pipelining (a reduce overlapping the transfer) wins.
PAIR_EXCHANGE_BYTES = 1024 * 1024


def _bind_host(rendezvous: Rendezvous | None, job: JobEnv | None) -> tuple[str, str]:
    """(address to bind, address to publish) for this rank's listener (``addresses.listen_address``, routed
    towards the rendezvous service or the Spark driver's service of the launch contract ``job``)."""
    return listen_address(meeting_host(rendezvous, job))


def _collective(name: str) -> Callable[[F], F]:
    """Check the backend is usable; on failure tell every peer and raise an error naming the culprit."""

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def run(self: RingBackend, *args: Any, **kwargs: Any) -> Any:
            self._check_usable(name)
            try:
                return method(self, *args, **kwargs)
            except (PeerFailureError, ProtocolError, AuthenticationError) as exc:
                self._collective_failed(exc, name)
                raise

        return run  # type: ignore[return-value]

    return wrap


def _flat(buf: np.ndarray, what: str) -> np.ndarray:
    if not isinstance(buf, np.ndarray):
        raise TypeError(f"{what} expects a numpy array, got {type(buf).__name__}")
    if not buf.flags.c_contiguous:
        raise ValueError(f"{what} needs a C-contiguous array (got strides {buf.strides})")
    return buf.reshape(-1)


class RingBackend(Backend):
    """The built-in backend (TCP mesh + same-host shared memory); see the module docstring."""

    name = "ring"

    def __init__(self, rank: int, size: int, rendezvous: Rendezvous | None, secret: bytes,
                 settings: Settings | None = None, job_id: str = "", *, shm_block_bytes: int = 1 << 20,
                 shm_slots: int = 64, frame_bytes: int = FRAME_BYTES,
                 pair_exchange_bytes: int = PAIR_EXCHANGE_BYTES, job: JobEnv | None = None) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a job of size {size}")
        self.rank, self.size = rank, size
        self.settings = settings if settings is not None else Settings.from_env()
        self.timeout_s = float(self.settings.timeout_s)
        self.job_id = job_id
        #: every TCP frame is encrypted (the launch contract's ``JobEnv.encrypt``: every rank must agree)
        self.encrypt = job is not None and job.encrypt
        self.local_rank, self.local_size, self.cross_rank, self.cross_size = 0, 1, 0, 1
        self.peers: dict[int, PeerSocket] = {}
        #: how collectives run (``ring_plans``): chosen once the mesh is up, from every rank's host identity
        self.plan: Plan = Solo()
        self._closed = False
        self._broken: PeerFailureError | None = None
        self._worker: SendWorker | None = None
        self._local_watcher: PeerWatcher | None = None  # the hierarchical allreduce's helper thread's
        self._hier_helper = hier_pipeline.Helper(f"spark-hvd-hier-{rank}")  # its thread starts at first use
        self._scratch = np.empty(0, dtype=np.uint8)
        self._listener: socket.socket | None = None
        self._frame = max(INLINE_SEND_BYTES, frame_bytes - frame_bytes % 64)
        self._pair_bytes = pair_exchange_bytes
        self._spin = False  # small two-rank exchanges spin before they sleep (every local rank may have a core)
        #: every rank runs rings with the compiled loop (``ringloop``): rings it supports use its smaller frames
        self._compiled = False
        #: every rank of the job is on this host's shared memory and can run ``ShmGroup.small_agreed``
        self._agreed_shm: ShmGroup | None = None
        self._agreed_last: tuple[Any, Any, tuple[int, int] | None] = (None, None, None)
        if size == 1:
            if rendezvous is not None:
                rendezvous.exchange(0, 1, b"{}")
            return
        if rendezvous is None:
            raise ValueError("a job of more than one rank needs a rendezvous")
        try:
            bind, publish = _bind_host(rendezvous, job)
            self._listener = open_listener(bind)
            port = self._listener.getsockname()[1]
            host_id = host_identity()
            use_shm = bool(self.settings.shm) and shm_available()
            info = {"host": publish, "port": port, "host_id": host_id, "machine": machine_identity(),
                    "pid": os.getpid(), "shm": use_shm, "nonce": new_nonce(),
                    "compiled_ring": ringloop.BUILT and self.settings.compiled_ring, "encrypt": self.encrypt,
                    "shm_agreed": self.settings.compiled_ring and shm_agreed_here()}
            values = rendezvous.exchange(rank, size, json.dumps(info).encode())
            infos = [json.loads(v) for v in values]
            check_encryption(rank, [bool(i.get("encrypt")) for i in infos])
            check_reachable([(i["host"], i.get("machine", "")) for i in infos])
            self._topology(infos)
            self._compiled = all(i.get("compiled_ring") for i in infos)
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            self._spin = self.local_size <= cores  # as shared memory spins: more ranks than cores, never
            self.peers = connect_mesh(rank, size, self._listener, [(i["host"], i["port"]) for i in infos],
                                      secret, job_id, self.timeout_s, encrypt=self.encrypt)
            for j, peer in self.peers.items():
                peer.where = f" on host {infos[j].get('machine', '').split('/', 1)[0]} ({infos[j]['host']})"
            self._listener.close()
            self._listener = None
            self._watcher = PeerWatcher(list(self.peers.values()))
            self._worker = SendWorker()
            self.plan = TcpRing()
            # shared memory among the ranks of this host: the whole job (all local) or one level of a hierarchy;
            # the plan builds its groups with every rank (or every rank stays on TCP)
            plan = ring_plans.choose(rank, size, [i["host_id"] for i in infos], all(i["shm"] for i in infos))
            self.plan = plan.build(ring_plans.Setup(
                rank, size, job_id, infos[0]["nonce"], self.timeout_s, shm_block_bytes, shm_slots,
                self.settings.shm_cma_bytes, self._small_allgather))
            group = getattr(self.plan, "shm", None)
            if self.plan.name == "shm" and group is not None and all(i.get("shm_agreed") for i in infos):
                self._agreed_shm = group
        except BaseException:
            self.close()
            raise
        logger.debug("rank %d/%d joined job %r: local %d/%d, cross %d/%d, transport %s", rank, size, job_id,
                     self.local_rank, self.local_size, self.cross_rank, self.cross_size, self.transport)

    def tunables(self) -> dict[str, int]:
        """``halving_doubling_bytes`` where this ring's TCP allreduces run among three or more ranks (``tcp``) or
        hosts (``hier``): the only place it changes which algorithm runs."""
        if self.tcp_ring_size >= 3:
            return {"halving_doubling_bytes": self.settings.halving_doubling_bytes}
        return {}

    def apply_tuning(self, values: Mapping[str, int]) -> None:
        """Each later TCP allreduce reads the new thresholds from ``settings``."""
        self.settings = dataclasses.replace(self.settings, **values)

    @property
    def transport(self) -> str:
        """The plan's name ("none", "tcp", "shm", "hier"), for logs and reports; collectives ask ``plan`` itself."""
        return self.plan.name

    @property
    def tcp_ring_size(self) -> int:
        """How many ranks the TCP leg of an allreduce runs among (0: none): the whole job on ``TcpRing``, one rank
        per host on ``Hierarchical`` (where halving-doubling and its threshold apply from 3)."""
        return self.plan.tcp_ring_size(self)

    @property
    def shm(self) -> ShmGroup | None:
        """This host's shared-memory group, where the plan has one."""
        return getattr(self.plan, "shm", None)

    @property
    def _cma(self) -> shm_cma.CmaPair | None:
        return getattr(self.plan, "cma", None)

    def _topology(self, infos: list[dict[str, Any]]) -> None:
        self.local_rank, self.local_size, self.cross_rank, self.cross_size = topology(
            [info["host_id"] for info in infos], self.rank)

    # -- state -------------------------------------------------------------------------------------------------
    def _check_usable(self, operation: str) -> None:
        if self._closed:
            raise ShutdownError(f"{operation}: the ring backend of rank {self.rank} is closed")
        if self._broken is not None:
            raise PeerFailureError(f"{operation}: the job is unusable since an earlier failure: {self._broken}",
                                   rank=self._broken.rank, operation=operation)

    def _collective_failed(self, exc: BaseException, operation: str) -> None:
        """After ``operation`` failed with ``exc``: mark the backend broken, tell every peer, and raise the failure a
        peer reported first if one did (the caller re-raises ``exc`` otherwise)."""
        reported = self._reported_failure(exc, operation)
        self._fail(reported or exc, operation)
        if reported is not None:
            raise reported from exc

    def _reported_failure(self, exc: BaseException, operation: str) -> PeerAbort | None:
        """After a connection failed: did some peer already report which rank failed (a pending ABORT frame)?

        A rank that noticed the failure first tells everyone and may close before its ABORT frame is read
        here; without this check this rank would blame that messenger instead of the rank that died.
        """
        if isinstance(exc, PeerAbort) or not isinstance(exc, PeerFailureError):
            return None
        for peer in self.peers.values():
            reported = peer.find_abort(operation)
            if reported is not None and reported.rank is not None:
                return reported
        return None

    def _fail(self, exc: BaseException, operation: str) -> None:
        culprit = getattr(exc, "rank", None)
        if self._broken is None:
            self._broken = exc if isinstance(exc, PeerFailureError) else PeerFailureError(
                str(exc), rank=culprit, operation=operation)
        reason = f"{operation} on rank {self.rank}: {exc}"
        for peer in self.peers.values():
            if peer.rank != culprit:
                peer.send_abort(culprit, reason)

    def _check_peers(self, operation: str) -> None:
        self._watcher.check(operation)

    def _check_local_peers(self, operation: str) -> None:
        """``_check_peers`` for this host's ranks only (the hierarchical allreduce's helper thread: the calling
        thread meanwhile owns the cross-host connections)."""
        if self._local_watcher is None:
            assert self.shm is not None
            self._local_watcher = PeerWatcher([self.peers[r] for r in self.shm.ranks if r != self.rank])
        self._local_watcher.check(operation)

    def close(self) -> None:
        """Close sockets, shared memory and the sender thread. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._hier_helper.close()
        if self._worker is not None:
            self._worker.stop()
        for peer in self.peers.values():
            if self._broken is None:
                peer.send_bye()
            try:
                peer.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            peer.close()
        if self._listener is not None:
            self._listener.close()
        self.plan.close()

    # -- point-to-point helpers --------------------------------------------------------------------------------
    def _exchange(self, send_peer: int, recv_peer: int, operation: str, nbytes: int = -1) -> RingExchange:
        """An exchange of frames with these peers; ``nbytes``: a two-rank exchange of this many bytes each way,
        which spins before it sleeps up to ``SPIN_MAX_BYTES`` (``spark_hvd.core.transport.tcp.SPIN_S``) where every rank
        of this host may have a core."""
        return RingExchange(self.peers[send_peer], self.peers[recv_peer], operation,
                            self._spin and 0 <= nbytes <= SPIN_MAX_BYTES)

    def _scratch_bytes(self, nbytes: int) -> np.ndarray:
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, dtype=np.uint8)
        return self._scratch[:nbytes]

    def _post(self, dst: int, data: np.ndarray, operation: str) -> bool:
        """Send ``data`` (a uint8 view) to ``dst`` in frames; returns True if the sender thread has work."""
        peer = self.peers[dst]
        n = data.nbytes
        if n <= INLINE_SEND_BYTES:
            if n:
                peer.send_data([memoryview(data)], operation)
            return False
        assert self._worker is not None
        for lo in range(0, n, self._frame):
            self._worker.post(peer, [memoryview(data[lo:lo + self._frame])], operation)
        return True

    def _wait_sent(self, posted: bool, operation: str) -> None:
        if posted:
            assert self._worker is not None
            self._worker.wait(self.timeout_s * 2, operation)

    def _recv(self, src: int, into: np.ndarray, operation: str) -> None:
        """Receive ``into.nbytes`` bytes (a uint8 view) from ``src``, frame by frame."""
        peer = self.peers[src]
        n = into.nbytes
        if n <= INLINE_SEND_BYTES:
            if n:
                peer.recv_data_into(memoryview(into), operation)
            return
        for lo in range(0, n, self._frame):
            peer.recv_data_into(memoryview(into[lo:lo + self._frame]), operation)

    def _small_allgather(self, payload: bytes, operation: str) -> list[bytes]:
        """Every rank's small ``payload`` (< 32 KiB), by rank, over the mesh."""
        for peer in self.peers.values():
            peer.send_data([payload], operation)
        out = []
        for r in range(self.size):
            out.append(payload if r == self.rank else self.peers[r].recv_message(operation))
        return out

    # -- ring steps over TCP -----------------------------------------------------------------------------------
    def _neighbours(self, members: Sequence[int] | None) -> tuple[int, int, int, int]:
        """(position, ring size, right rank, left rank) of this rank in the ring of ``members`` (default: all)."""
        if members is None:
            n, r = self.size, self.rank
            return r, n, (r + 1) % n, (r - 1) % n
        n, r = len(members), members.index(self.rank)
        return r, n, members[(r + 1) % n], members[(r - 1) % n]

    def _sub_bytes(self, bounds: Sequence[int], itemsize: int, frame: int = 0) -> int:
        """Bytes per pipelined sub-chunk (one frame) for chunks ``bounds`` (in elements), frames of at most
        ``frame`` bytes (default: the backend's): the same on every rank."""
        frame = frame or self._frame
        largest = max(hi - lo for lo, hi in zip(bounds, bounds[1:], strict=False)) * itemsize
        part = -(-largest // SUB_CHUNKS)
        return max(min(SUB_CHUNK_MIN_BYTES, frame), min(frame, part + (-part % 64)))

    def _ring(self, flat: np.ndarray, bounds: Sequence[int], operation: str, members: Sequence[int] | None = None,
              *, reduce_steps: int = 0, gather_steps: int = 0, op: ReduceOp = ReduceOp.SUM, bfloat16: bool = False,
              average: bool = False, segments: list[np.ndarray] | None = None, cuts: Sequence[int] = ()) -> None:
        """Pipelined ring steps on ``flat`` split at ``bounds`` (elements): ``reduce_steps`` reduce-scatter steps,
        then ``gather_steps`` allgather steps.

        With ``reduce_steps`` > 0, step t sends chunk ``p - t - 1`` and receives chunk ``p - t - 2`` (p: ring
        position), else (a plain allgather) ``p - t`` and ``p - t - 1``; either way the chunk received at step t
        is the one sent at step t + 1. Each chunk moves in sub-chunks (one frame each): as soon as a sub-chunk is
        received (and reduced into place from a preallocated scratch frame) it is queued for the next step, so
        receiving, reducing and sending overlap across steps and phases (``RingExchange``, no thread hand-off).
        ``average`` divides this rank's chunk by the ring size at the end of the reduce-scatter.

        Where every rank has the compiled loop and it supports the dtype and op (``ringloop``), frames are at most
        ``ringloop.FRAME_BYTES`` and this rank runs the compiled loop, unless a benchmark traces frames (then the
        Python loop runs the same frames).

        ``segments``: the arrays ``flat`` (then empty, of their dtype) stands for, their elements one after the
        other (``bounds`` count them): the compiled loop reduces each where it lies (the caller checked it runs:
        ``_tcp_allreduce_fused``); no frame crosses an end of one from ``SEGMENT_CUT_BYTES``. ``cuts``: the same
        cuts (``segment_cuts``) of arrays packed into ``flat`` (a rank tracing frames runs the Python loop on the
        frames its peers run the segments in).
        """
        p, n, right, left = self._neighbours(members)
        total = reduce_steps + gather_steps
        if total == 0 or (flat.size == 0 and not segments):
            return
        item = flat.itemsize
        raw = flat.view(np.uint8)
        compiled = self._compiled and ringloop.supports(flat.dtype, op, bfloat16, reduce_steps)
        sub = self._sub_bytes(bounds, item, min(self._frame, ringloop.FRAME_BYTES) if compiled else 0)
        shift = 1 if reduce_steps else 0
        cuts = segment_cuts(segments) if segments else cuts

        def pieces(chunk: int) -> list[tuple[int, int]]:
            return frame_spans(bounds[chunk] * item, bounds[chunk + 1] * item, sub, cuts)

        plan = [(t, lo, hi) for t in range(total) for lo, hi in pieces((p - t - shift - 1) % n)]
        if segments:
            assert compiled and tcp.loop.TRACE is None
            both = self._scratch_bytes(2 * sub)  # the scratch frame, and the frame gathered to send
            ringloop.run(self.peers[right], self.peers[left], operation, flat, both[:sub], pieces((p - shift) % n),
                         plan, reduce_steps, total, op, n, average=average, bfloat16=bfloat16, segments=segments,
                         gather=both[sub:])
            return
        if compiled and tcp.loop.TRACE is None:
            ringloop.run(self.peers[right], self.peers[left], operation, flat,
                         self._scratch_bytes(sub) if reduce_steps else np.empty(0, np.uint8), pieces((p - shift) % n),
                         plan, reduce_steps, total, op, n, average=average, bfloat16=bfloat16)
            return
        scratch = memoryview(self._scratch_bytes(sub)) if reduce_steps else memoryview(b"")  # one frame, reused
        receives = [scratch[:hi - lo] if t < reduce_steps else memoryview(raw[lo:hi]) for t, lo, hi in plan]

        def received(i: int) -> memoryview | None:
            t, lo, hi = plan[i]
            if t < reduce_steps:
                part = flat[lo // item:hi // item]
                reduce_into(part, np.frombuffer(receives[i], dtype=flat.dtype), op, bfloat16)
                if average and t == reduce_steps - 1:
                    divide_average(part, n, bfloat16)
            return memoryview(raw[lo:hi]) if t + 1 < total else None

        first = [memoryview(raw[lo:hi]) for lo, hi in pieces((p - shift) % n)]
        self._exchange(right, left, operation).run(first, receives, received)

    def _ring_reduce_scatter(self, flat: np.ndarray, bounds: Sequence[int], op: ReduceOp, bfloat16: bool,
                             operation: str, members: Sequence[int] | None = None) -> None:
        """After N-1 steps the member at ring position p holds the reduction of ``bounds[p]:bounds[p+1]``."""
        n = self._neighbours(members)[1]
        self._ring(flat, bounds, operation, members, reduce_steps=n - 1, op=op, bfloat16=bfloat16)

    def _ring_reduce_scatter_copy(self, flat: np.ndarray, bounds: Sequence[int], op: ReduceOp, bfloat16: bool,
                                  operation: str) -> np.ndarray | None:
        """``_ring_reduce_scatter`` of every rank that leaves ``flat`` as it was, by the compiled loop's segments:
        the ring reduces into every chunk but ``p - 1`` (sent at step 0, never received), so that chunk stays in
        ``flat`` and the others are copies; returns the copy of this rank's chunk p (AVERAGE summed). None (nothing
        sent) where the compiled loop does not run it (or ``flat`` is read-only): the caller copies ``flat``."""
        p, n = self.rank, self.size
        if not (self._compiled and tcp.loop.TRACE is None and flat.flags.writeable
                and ringloop.supports(flat.dtype, op, bfloat16, n - 1)):
            return None
        kept = (p - 1) % n
        chunks = [flat[lo:hi] if j == kept else flat[lo:hi].copy()
                  for j, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False))]
        self._ring(np.empty(0, flat.dtype), bounds, operation, reduce_steps=n - 1, op=op, bfloat16=bfloat16,
                   segments=[c for c in chunks if c.size])
        return chunks[p]

    def _ring_allgather(self, raw: np.ndarray, bounds: Sequence[int], operation: str,
                        members: Sequence[int] | None = None) -> None:
        """Ring position p holds bytes ``bounds[p]:bounds[p+1]`` of ``raw``; afterwards every member holds all."""
        n = self._neighbours(members)[1]
        self._ring(raw, bounds, operation, members, gather_steps=n - 1)

    def _tcp_allreduce(self, flat: np.ndarray, op: ReduceOp, bfloat16: bool, operation: str,
                       members: Sequence[int] | None = None) -> None:
        """Bandwidth-optimal ring allreduce over TCP among ``members`` (default: every rank), pipelined; two
        members and a small array: one exchange (``_pair_exchange``); more members and an array up to
        ``settings.log_depth_bytes``: recursive doubling (log2 N exchanges, not 2(N-1) ring steps)."""
        p, n = self._neighbours(members)[:2]
        if n == 2 and flat.nbytes <= self._pair_bytes:
            self._pair_exchange(flat, op, bfloat16, operation, members)
            return
        if n > 2 and flat.nbytes <= self.settings.log_depth_bytes:
            recursive_doubling.allreduce(flat, op, bfloat16, members or range(self.size), p,
                                         _MeshPeers(self, operation), self._scratch_bytes(flat.nbytes))
            return
        if n > 2 and 0 < self.settings.halving_doubling_bytes <= flat.nbytes:
            halving_doubling.allreduce(flat, op, bfloat16, members or range(self.size), p, _MeshPeers(self, operation),
                                       self._scratch_bytes(halving_doubling.scratch_bytes(flat.size, flat.itemsize, n)))
            return
        self._ring(flat, even_bounds(flat.size, n), operation, members, reduce_steps=n - 1, gather_steps=n - 1,
                   op=op, bfloat16=bfloat16, average=op is ReduceOp.AVERAGE)

    def _tcp_allreduce_fused(self, flats: Sequence[np.ndarray], op: ReduceOp, bfloat16: bool, operation: str) -> bool:
        """Allreduce several non-empty same-dtype arrays over TCP where they lie: one ring over them as one buffer
        (``_ring``'s ``segments``), where ``_tcp_allreduce`` would run the ring on them packed and every rank runs
        the compiled loop. False (nothing sent) otherwise: the caller packs them."""
        n = self.size
        nbytes = sum(f.nbytes for f in flats)
        if n == 2:
            runs_ring = nbytes > self._pair_bytes
        else:
            runs_ring = nbytes > self.settings.log_depth_bytes and not (
                0 < self.settings.halving_doubling_bytes <= nbytes)
        if not (runs_ring and self._compiled and ringloop.supports(flats[0].dtype, op, bfloat16, n - 1)):
            return False
        bounds = even_bounds(nbytes // flats[0].itemsize, n)
        steps = {"reduce_steps": n - 1, "gather_steps": n - 1, "op": op, "bfloat16": bfloat16,
                 "average": op is ReduceOp.AVERAGE}
        if tcp.loop.TRACE is None:
            self._ring(np.empty(0, flats[0].dtype), bounds, operation, segments=list(flats), **steps)
            return True
        # a rank tracing frames: the Python loop on the arrays packed, in the frames its peers run the segments in
        packed = np.concatenate(flats)
        self._ring(packed, bounds, operation, cuts=segment_cuts(flats), **steps)
        at = 0
        for f in flats:
            f[...] = packed[at:at + f.size]
            at += f.size
        return True

    def _pair_exchange(self, flat: np.ndarray, op: ReduceOp, bfloat16: bool, operation: str,
                       members: Sequence[int] | None) -> None:
        """Allreduce between two ranks: each sends its whole array and reduces the other's into it once every
        byte left (one round trip where the ring's two phases take two; ``a op b`` and ``b op a`` are the same
        bits for every ``ReduceOp``, so both ranks hold the same result)."""
        peer = self._neighbours(members)[2]
        raw = flat.view(np.uint8)
        theirs = self._scratch_bytes(raw.nbytes)
        pieces = range(0, raw.nbytes, self._frame)
        self._exchange(peer, peer, operation, raw.nbytes).run([memoryview(raw[lo:lo + self._frame]) for lo in pieces],
                                                  [memoryview(theirs[lo:lo + self._frame]) for lo in pieces],
                                                  lambda i: None)
        reduce_into(flat, theirs.view(flat.dtype), op, bfloat16)
        if op is ReduceOp.AVERAGE:
            divide_average(flat, 2, bfloat16)

    def _allreduce_flat(self, flat: np.ndarray, op: ReduceOp, bfloat16: bool, operation: str) -> None:
        """Allreduce one flat array in place as the plan says."""
        self.plan.allreduce(self, flat, op, bfloat16, operation)

    @property
    def fuses_in_place(self) -> bool:
        """True on shared memory (``allreduce_fused`` copies the arrays straight into the staging slots and the
        results straight back, with no fusion buffer) and over TCP where every rank runs the compiled loop (a
        round large enough for the ring is reduced where it lies, any number of ranks: ``_tcp_allreduce_fused``;
        ``TcpRing.fuses``)."""
        return self.plan.fuses(self)

    @property
    def agrees_in_band(self) -> bool:
        """Two ranks over TCP: ``allreduce_agreed`` sends the agreement as the data's first frame."""
        return self.plan.agrees_in_band(self.size)

    # -- Backend API -------------------------------------------------------------------------------------------
    @_collective("allreduce")
    def allreduce(self, buf: np.ndarray, op: ReduceOp, *, bfloat16: bool = False) -> None:
        """Reduce ``buf`` across ranks in place (see ``Backend.allreduce``)."""
        flat = _flat(buf, "allreduce")
        check_dtype(flat, bfloat16)
        if self.size == 1 or flat.size == 0:
            return
        self._allreduce_flat(flat, op, bfloat16, "allreduce")

    @_collective("allreduce")
    def allreduce_fused(self, bufs: Sequence[np.ndarray], op: ReduceOp, *, bfloat16: bool = False) -> None:
        """Allreduce several same-dtype arrays as one collective, in place.

        With shared memory the arrays are copied straight into the shared staging slots and the results
        straight back (no fusion buffer); over TCP with the compiled loop one ring runs over them where they lie
        when the round is large enough for the ring (else they are packed into one array).
        """
        flats = [_flat(b, "allreduce_fused") for b in bufs]
        if not flats or self.size == 1:
            return
        dtype = flats[0].dtype
        for i, f in enumerate(flats):
            if f.dtype != dtype:
                raise TypeError(f"allreduce_fused: array {i} has dtype {f.dtype}, array 0 has {dtype}")
            check_dtype(f, bfloat16)
        flats = [f for f in flats if f.size]
        if not flats:
            return
        self.plan.allreduce_fused(self, flats, op, bfloat16, "allreduce")

    def agrees_small(self, dtype: np.dtype, op: ReduceOp) -> int:
        """Every rank on this host's shared memory with the compiled small path: ``allreduce_agreed`` takes arrays of
        up to this many bytes in one small allreduce, the flag ahead of the data in the slot
        (``ShmGroup.small_agreed``); 0 otherwise."""
        group = self._agreed_shm
        if group is None or group.agreed_codes(np.dtype(dtype), op) is None:
            return 0
        return group.small_bytes - AGREED_FLAG_BYTES

    def allreduce_agreed(self, buf: np.ndarray, op: ReduceOp, agree: bool) -> bool:
        """See ``Backend.allreduce_agreed``: a small array on shared memory (``agrees_small``: a speculative round's
        path, kept short), or two ranks over TCP (``spark_hvd.core.algorithms.agreed``)."""
        group = self._agreed_shm
        if group is None or buf.nbytes > group.small_bytes - AGREED_FLAG_BYTES:
            return self._allreduce_agreed_tcp(buf, op, agree)
        if self._closed or self._broken is not None:
            self._check_usable("allreduce")
        dtype = buf.dtype
        last = self._agreed_last  # (dtype, op, codes) of the last call: a loop's next call looks nothing up
        if last[0] is dtype and last[1] is op:
            codes = last[2]
        else:
            codes = group.agreed_codes(dtype, op)
            if codes is None:
                raise ValueError(f"allreduce_agreed: shared memory's small path takes no {dtype} {op.value}")
            self._agreed_last = (dtype, op, codes)
        if not agree:
            buf = np.empty(0, dtype)  # a template only: never read or written
        elif not (buf.flags.c_contiguous and buf.flags.writeable):
            raise ValueError(f"allreduce needs a C-contiguous, writable array (got strides {buf.strides})")
        try:
            return group.small_agreed(buf, agree, codes, "allreduce", self._check_peers)
        except (PeerFailureError, ProtocolError, AuthenticationError) as exc:
            self._collective_failed(exc, "allreduce")
            raise

    @_collective("allreduce")
    def _allreduce_agreed_tcp(self, buf: np.ndarray, op: ReduceOp, agree: bool) -> bool:
        """``allreduce_agreed`` between two ranks over TCP."""
        if not self.agrees_in_band:
            raise NotImplementedError(f"allreduce_agreed needs two ranks over TCP, not {self.size} over "
                                      f"{self.transport}")
        flat = buf.reshape(-1)
        if agree:
            flat = _flat(buf, "allreduce")
            check_dtype(flat, False)
        pair = flat.nbytes <= self._pair_bytes  # as ``_tcp_allreduce`` chooses: one round trip, else the ring
        compiled = not pair and self._compiled and ringloop.supports(flat.dtype, op, False, 1)
        sub = self._frame if pair else self._sub_bytes(even_bounds(flat.size, 2), flat.itemsize,
                                                       min(self._frame, ringloop.FRAME_BYTES) if compiled else 0)
        other = 1 - self.rank
        exchange = self._exchange(other, other, "allreduce", flat.nbytes)
        ring = None
        if compiled and tcp.loop.TRACE is None:
            peer = self.peers[other]

            def ring(first: list[tuple[int, int]], plan: list[tuple[int, int, int]]) -> None:
                ringloop.run(peer, peer, "allreduce", flat, self._scratch_bytes(sub), first, plan, 1, 2, op, 2)

        return agreed.allreduce(exchange, self.rank, flat, agree, op, False, self._scratch_bytes, sub,
                                pair, ring, agreed.COMPILED_EAGER_BYTES if compiled else agreed.EAGER_BYTES)

    @_collective("allgather")
    def allgather(self, buf: np.ndarray) -> np.ndarray:
        """Concatenate every rank's ``buf`` along the first dimension (which may differ by rank)."""
        if not isinstance(buf, np.ndarray):
            raise TypeError(f"allgather expects a numpy array, got {type(buf).__name__}")
        buf = np.ascontiguousarray(buf)
        if buf.ndim == 0:
            buf = buf.reshape(1)
        if self.size == 1:
            return buf.copy()
        meta = json.dumps([buf.shape[0], buf.dtype.str, list(buf.shape[1:])]).encode()
        metas = [json.loads(m) for m in self.plan.small_allgather(self, meta, "allgather")]
        odd = [r for r, m in enumerate(metas) if m[1:] != metas[0][1:]]
        if odd:
            raise TensorMismatchError(
                "allgather: ranks disagree on dtype or trailing shape: " + ", ".join(
                    f"rank {r}: {m[1]} {tuple(m[2])}" for r, m in enumerate(metas)), ranks=[0, *odd])
        rows = [m[0] for m in metas]
        out = np.empty((sum(rows), *buf.shape[1:]), dtype=buf.dtype)
        row_bytes = buf.dtype.itemsize * int(np.prod(buf.shape[1:], dtype=np.int64))
        bounds = [0]
        for n in rows:
            bounds.append(bounds[-1] + n * row_bytes)
        raw = out.reshape(-1).view(np.uint8)
        raw[bounds[self.rank]:bounds[self.rank + 1]] = buf.reshape(-1).view(np.uint8)
        self.plan.allgather(self, raw, bounds, "allgather")
        return out

    @_collective("broadcast")
    def broadcast(self, buf: np.ndarray, root: int) -> None:
        """Overwrite ``buf`` on every rank with root's ``buf``, in place."""
        if not 0 <= root < self.size:
            raise ValueError(f"broadcast: root rank {root} is outside a job of size {self.size}")
        flat = _flat(buf, "broadcast")
        if self.size == 1 or flat.size == 0:
            return
        self.plan.broadcast(self, flat, root, "broadcast")

    def _tcp_broadcast(self, flat: np.ndarray, root: int, operation: str) -> None:
        """Root sends ``flat`` to every other rank over TCP."""
        raw = flat.view(np.uint8)
        if self.rank == root:
            posted = False
            for dst in range(self.size):
                if dst != root:
                    posted = self._post(dst, raw, "broadcast") or posted
            self._wait_sent(posted, "broadcast")
        else:
            self._recv(root, raw, "broadcast")

    @_collective("alltoall")
    def alltoall(self, buf: np.ndarray, splits: Sequence[int] | None = None) -> tuple[np.ndarray, list[int]]:
        """Send ``splits[i]`` rows of ``buf`` to rank i; return the rows received and how many from each."""
        if not isinstance(buf, np.ndarray):
            raise TypeError(f"alltoall expects a numpy array, got {type(buf).__name__}")
        buf, splits = alltoall_args(buf, splits, self.size)
        if self.size == 1:
            return buf.copy(), splits
        meta = json.dumps([splits, buf.dtype.str, list(buf.shape[1:])]).encode()
        metas = [json.loads(m) for m in self._small_allgather(meta, "alltoall")]
        odd = [r for r, m in enumerate(metas) if m[1:] != metas[0][1:]]
        if odd:
            raise TensorMismatchError(
                "alltoall: ranks disagree on dtype or trailing shape: " + ", ".join(
                    f"rank {r}: {m[1]} {tuple(m[2])}" for r, m in enumerate(metas)), ranks=[0, *odd])
        recv_splits = [m[0][self.rank] for m in metas]
        row_bytes = buf.dtype.itemsize * int(np.prod(buf.shape[1:], dtype=np.int64))
        out = np.empty((sum(recv_splits), *buf.shape[1:]), dtype=buf.dtype)
        send_raw = buf.reshape(-1).view(np.uint8)
        recv_raw = out.reshape(-1).view(np.uint8)
        send_at = np.concatenate([[0], np.cumsum(splits)]) * row_bytes
        recv_at = np.concatenate([[0], np.cumsum(recv_splits)]) * row_bytes
        r = self.rank
        recv_raw[recv_at[r]:recv_at[r + 1]] = send_raw[send_at[r]:send_at[r + 1]]
        for s in range(1, self.size):
            dst, src = (r + s) % self.size, (r - s) % self.size
            posted = self._post(dst, send_raw[send_at[dst]:send_at[dst + 1]], "alltoall")
            self._recv(src, recv_raw[recv_at[src]:recv_at[src + 1]], "alltoall")
            self._wait_sent(posted, "alltoall")
        return out, recv_splits

    @_collective("reducescatter")
    def reducescatter(self, buf: np.ndarray, op: ReduceOp, *, bfloat16: bool = False) -> np.ndarray:
        """Reduce ``buf`` across ranks and return this rank's rows (the first ``rows % size`` ranks get one more)."""
        if not isinstance(buf, np.ndarray):
            raise TypeError(f"reducescatter expects a numpy array, got {type(buf).__name__}")
        if buf.ndim == 0:
            raise ValueError("reducescatter needs an array with at least one dimension")
        check_dtype(buf, bfloat16)
        rows = even_bounds(buf.shape[0], self.size)
        row_elems = int(np.prod(buf.shape[1:], dtype=np.int64))
        shape = (rows[self.rank + 1] - rows[self.rank], *buf.shape[1:])
        flat = np.ascontiguousarray(buf).reshape(-1)
        if self.size == 1 or flat.size == 0:
            lo, hi = rows[self.rank] * row_elems, rows[self.rank + 1] * row_elems
            return flat[lo:hi].copy().reshape(shape)
        mine = self.plan.reducescatter(self, flat, [b * row_elems for b in rows], op, bfloat16, "reducescatter")
        return mine.reshape(shape)

    @_collective("barrier")
    def barrier(self) -> None:
        """Return once every rank has called it; on one host's shared memory, the ranks leave it together."""
        if self.size > 1:
            self.plan.barrier(self, "barrier")

    def leave_together(self) -> None:
        """See ``Backend.leave_together``: on one host's shared memory, a bounded spin until every peer finished
        the last collective (``ShmGroup.release``); elsewhere nothing."""
        self.plan.leave_together()

    def __repr__(self) -> str:
        return (f"RingBackend(rank={self.rank}, size={self.size}, local={self.local_rank}/{self.local_size}, "
                f"cross={self.cross_rank}/{self.cross_size}, transport={self.transport})")


def frame_spans(lo: int, hi: int, sub: int, cuts: Sequence[int] = ()) -> list[tuple[int, int]]:
    """The frames (lo, hi) of a ring's chunk of bytes ``lo:hi``: at most ``sub`` bytes each, cut at ``cuts``
    (sorted byte offsets: ``segment_cuts``)."""
    edges = [lo, *(c for c in cuts if lo < c < hi), hi]
    return [(at, min(b, at + sub)) for a, b in zip(edges, edges[1:], strict=False) for at in range(a, b, sub)]


def segment_cuts(segments: Sequence[np.ndarray]) -> list[int]:
    """The byte offsets (sorted) where an array of ``segments`` from ``SEGMENT_CUT_BYTES`` starts or ends, in the
    buffer they stand for: the ring's frames are cut there."""
    cuts, at = [], 0
    for seg in segments:
        if seg.nbytes >= SEGMENT_CUT_BYTES:
            if not cuts or cuts[-1] != at:
                cuts.append(at)
            cuts.append(at + seg.nbytes)
        at += seg.nbytes
    return cuts


class _MeshPeers:
    """``recursive_doubling.Peers`` over the backend's authenticated TCP mesh."""

    def __init__(self, backend: RingBackend, operation: str) -> None:
        self.backend, self.operation = backend, operation

    def send(self, dst: int, data: np.ndarray) -> None:
        self.backend._wait_sent(self.backend._post(dst, data, self.operation), self.operation)

    def recv(self, src: int, into: np.ndarray) -> None:
        self.backend._recv(src, into, self.operation)

    def exchange(self, peer: int, data: np.ndarray, into: np.ndarray) -> None:
        frame = self.backend._frame
        pieces = range(0, data.nbytes, frame)
        self.backend._exchange(peer, peer, self.operation).run([memoryview(data[lo:lo + frame]) for lo in pieces],
                                                               [memoryview(into[lo:lo + frame]) for lo in pieces],
                                                               lambda i: None)


__all__ = ["RingBackend", "host_identity", "even_bounds"]
