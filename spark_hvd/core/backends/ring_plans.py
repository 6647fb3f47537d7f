"""How the ring backend runs its collectives: one typed plan per job, chosen once from the topology.

``choose(rank, size, host_ids, shm_everywhere)`` looks at every rank's host identity once (at setup, the same on
every rank) and returns one of

* ``Solo``: a job of one rank; nothing to send;
* ``TcpRing``: one rank per host, or shared memory off on some rank: the TCP mesh's ring (pair exchange, recursive
  and halving-doubling by size: ``RingBackend._tcp_allreduce``);
* ``ShmHost``: every rank on this host: the pipelined shared-memory allreduce (``transport.shm``; two ranks and
  large arrays: single-copy by cross-memory attach, ``transport.shm_cma``); broadcasts through shared memory too;
* ``Hierarchical``: ranks share hosts across several hosts: shared memory within each host, the TCP ring between
  them (host leaders, or with as many ranks on every host and large arrays every local rank carrying one slice,
  ``algorithms.hier_pipeline``).

``plan.build(setup)`` then builds the groups the plan needs (the shared-memory segments of this host, the
cross-memory pair) together with the other ranks; a plan whose groups cannot be built on every rank gives way to
``TcpRing`` on every rank alike. The backend asks its plan, never a name: ``plan.allreduce``,
``plan.allreduce_fused``, ``plan.broadcast``, ``plan.reducescatter``, ``plan.allgather`` (and its metadata,
``plan.small_allgather``), ``plan.fuses_in_place``, ``plan.agrees_in_band``. ``plan.name`` ("none", "tcp", "shm",
"hier") is for logs, reprs and tests only.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from spark_hvd.core.algorithms import hier_pipeline
from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.reduce import divide_average
from spark_hvd.core.transport import shm_bind, shm_cma, shm_slices
from spark_hvd.core.transport.shm import ShmGroup, segment_path, unlink_quietly

if TYPE_CHECKING:
    from spark_hvd.core.backends.ring import RingBackend

logger = logging.getLogger(__name__)

#: Hierarchical allreduces from this size split the cross-host leg over every local rank (below, one sync per
#: local rank costs more than the leader's whole leg).
HIER_SPLIT_BYTES = 256 * 1024


def even_bounds(n: int, parts: int) -> list[int]:
    """``parts + 1`` boundaries splitting ``n`` items as evenly as possible, larger parts first."""
    base, extra = divmod(n, parts)
    bounds = [0]
    for k in range(parts):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return bounds


def _unpack(packed: np.ndarray, segs: Sequence[np.ndarray]) -> None:
    offset = 0
    for seg in segs:
        seg[...] = packed[offset:offset + seg.size]
        offset += seg.size


@dataclass(frozen=True)
class Setup:
    """What building a plan's groups needs: this rank, the job, the shared-memory sizes and a small allgather over
    the TCP mesh (every rank builds the same plan, so every rank joins the same allgathers)."""

    rank: int
    size: int
    job_id: str
    nonce: str  #: rank 0's, names the job's shared-memory segments
    timeout_s: float
    shm_block_bytes: int
    shm_slots: int
    cma_bytes: int
    allgather: Callable[[bytes, str], list[bytes]]


class Plan:
    """The interface every plan offers the backend (see the module docstring)."""

    name: ClassVar[str]
    #: ``allreduce_fused`` copies the arrays straight into the staging slots and back (no fusion buffer)
    fuses_in_place: ClassVar[bool] = False
    #: a reducescatter is an allreduce and a slice (``Hierarchical``: no reduce-scatter across its two transports)
    scatters_by_allreduce: ClassVar[bool] = False

    def build(self, setup: Setup) -> Plan:
        """This plan with its groups built on every rank (or the plan every rank falls back to)."""
        return self

    def agrees_in_band(self, size: int) -> bool:
        """Whether ``allreduce_agreed`` may send the agreement as the data's first frame."""
        return False

    def fuses(self, backend: RingBackend) -> bool:
        """Whether ``allreduce_fused`` reduces the arrays where they lie on this backend (``fuses_in_place``)."""
        return self.fuses_in_place

    def tcp_ring_size(self, backend: RingBackend) -> int:
        """How many ranks a TCP allreduce of this plan runs among (0: none)."""
        return 0

    def allreduce(self, backend: RingBackend, flat: np.ndarray, op: ReduceOp, bfloat16: bool, operation: str) -> None:
        raise NotImplementedError

    def allreduce_fused(self, backend: RingBackend, flats: Sequence[np.ndarray], op: ReduceOp, bfloat16: bool,
                        operation: str) -> None:
        """Allreduce several non-empty same-dtype arrays as one: packed into one (the TCP paths need one array)."""
        packed = flats[0] if len(flats) == 1 else np.concatenate(flats)
        self.allreduce(backend, packed, op, bfloat16, operation)
        if len(flats) > 1:
            _unpack(packed, flats)

    def broadcast(self, backend: RingBackend, flat: np.ndarray, root: int, operation: str) -> None:
        backend._tcp_broadcast(flat, root, operation)

    def reducescatter(self, backend: RingBackend, flat: np.ndarray, bounds: Sequence[int], op: ReduceOp,
                      bfloat16: bool, operation: str) -> np.ndarray:
        """A new array: this rank's slice ``bounds[rank]:bounds[rank + 1]`` (elements) of ``flat`` reduced over
        every rank (AVERAGE divided); ``flat`` is left as it was. Here the TCP ring's reduce-scatter half (N-1
        steps): with the compiled loop over copies of the chunks it reduces into and ``flat``'s one chunk it only
        sends (``RingBackend._ring_reduce_scatter_copy``: at N=2 only this rank's half is copied), else on a copy
        of ``flat``; or an allreduce and a slice."""
        lo, hi = bounds[backend.rank], bounds[backend.rank + 1]
        if not self.scatters_by_allreduce:
            mine = backend._ring_reduce_scatter_copy(flat, bounds, op, bfloat16, operation)
            if mine is not None:
                if op is ReduceOp.AVERAGE:
                    divide_average(mine, backend.size, bfloat16)
                return mine
        work = flat.copy()
        if self.scatters_by_allreduce:
            self.allreduce(backend, work, op, bfloat16, operation)
            return work[lo:hi].copy()
        backend._ring_reduce_scatter(work, bounds, op, bfloat16, operation)
        if op is ReduceOp.AVERAGE:
            divide_average(work[lo:hi], backend.size, bfloat16)
        return work[lo:hi].copy()

    def small_allgather(self, backend: RingBackend, payload: bytes, operation: str) -> list[bytes]:
        """Every rank's small ``payload``, by rank: one message from every rank over the mesh."""
        return backend._small_allgather(payload, operation)

    def allgather(self, backend: RingBackend, raw: np.ndarray, bounds: Sequence[int], operation: str) -> None:
        """Rank r holds bytes ``bounds[r]:bounds[r + 1]`` of ``raw``; afterwards every rank holds all: the TCP
        ring's allgather half (N-1 steps)."""
        backend._ring_allgather(raw, bounds, operation)

    def barrier(self, backend: RingBackend, operation: str) -> None:
        """Return once every rank has called it: an empty message from every rank over the mesh."""
        backend._small_allgather(b"", operation)

    def leave_together(self) -> None:
        """After a barrier's collective: hold on (briefly, never failing) until the peers finished it too."""

    def close(self) -> None:
        """Release the plan's groups."""


@dataclass(frozen=True)
class Solo(Plan):
    """A job of one rank: every collective is the identity (the backend returns before asking the plan)."""

    name: ClassVar[str] = "none"
    fuses_in_place: ClassVar[bool] = True

    def allreduce(self, backend: RingBackend, flat: np.ndarray, op: ReduceOp, bfloat16: bool, operation: str) -> None:
        return None


@dataclass(frozen=True)
class TcpRing(Plan):
    """Every rank over the TCP mesh (one rank per host, or shared memory off)."""

    name: ClassVar[str] = "tcp"

    def agrees_in_band(self, size: int) -> bool:
        return size == 2

    def tcp_ring_size(self, backend: RingBackend) -> int:
        return backend.size

    def fuses(self, backend: RingBackend) -> bool:
        """Every rank runs the compiled loop: a fused allreduce large enough for the ring reduces the arrays where
        they lie, any number of ranks (``RingBackend._tcp_allreduce_fused``); a smaller one (one exchange, or
        recursive doubling from three ranks) packs them, as a fusion buffer would. Not from three ranks with
        halving-doubling on (``settings.halving_doubling_bytes``): it needs one array, so large rounds would be
        packed whole; the engine's fusion buffer then packs them in ``fusion_threshold`` pieces."""
        return backend._compiled and not (backend.size >= 3 and backend.settings.halving_doubling_bytes > 0)

    def allreduce(self, backend: RingBackend, flat: np.ndarray, op: ReduceOp, bfloat16: bool, operation: str) -> None:
        backend._tcp_allreduce(flat, op, bfloat16, operation)

    def allreduce_fused(self, backend: RingBackend, flats: Sequence[np.ndarray], op: ReduceOp, bfloat16: bool,
                        operation: str) -> None:
        """One ring over the arrays where they lie where it runs (``RingBackend._tcp_allreduce_fused``), else
        packed."""
        if len(flats) == 1 or not backend._tcp_allreduce_fused(flats, op, bfloat16, operation):
            super().allreduce_fused(backend, flats, op, bfloat16, operation)


def _join_shm(setup: Setup, local_ranks: Sequence[int]) -> ShmGroup | None:
    """This host's shared-memory group, created, mapped and unlinked with every rank of the job (two allgathers
    over the mesh: created everywhere, mapped everywhere); None on every rank if any rank failed.

    Segments are created only now (after every rank joined the mesh) and unlinked as soon as every local rank mapped
    them; their names are known to every rank, which removes them all if setup fails."""
    paths = [segment_path(setup.job_id, setup.nonce, r) for r in local_ranks]
    segment: ShmGroup | None = None
    try:
        ok = True
        try:
            segment = ShmGroup(paths, list(local_ranks).index(setup.rank), local_ranks, setup.timeout_s,
                               setup.shm_block_bytes, setup.shm_slots)
        except OSError as exc:
            logger.warning("rank %d could not create shared memory (%s); using TCP", setup.rank, exc)
            ok = False
        created = setup.allgather(b"1" if ok else b"0", "setup")
        if segment is not None and all(f == b"1" for f in created):
            try:
                segment.attach()
            except OSError as exc:
                logger.warning("rank %d could not map its peers' shared memory (%s); using TCP", setup.rank, exc)
                ok = False
        else:
            ok = False
        attached = setup.allgather(b"1" if ok else b"0", "setup")
        for path in paths:
            unlink_quietly(path)
        if all(f == b"1" for f in attached):
            segment, joined = None, segment
            joined.unbind = shm_bind.bind(joined.local, joined.size)  # a share of the CPUs of its own (shm_bind)
            return joined
        return None
    finally:
        if segment is not None:
            segment.close()
        for path in paths:
            unlink_quietly(path)


@dataclass(frozen=True)
class ShmHost(Plan):
    """Every rank on this host: shared memory (``shm``), and for two ranks the cross-memory pair (``cma``)."""

    name: ClassVar[str] = "shm"
    fuses_in_place: ClassVar[bool] = True
    local_ranks: tuple[int, ...] = ()
    shm: ShmGroup | None = None
    cma: shm_cma.CmaPair | None = None

    def build(self, setup: Setup) -> Plan:
        group = _join_shm(setup, self.local_ranks)
        if group is None:
            return TcpRing()
        cma = None
        if setup.size == 2 and setup.cma_bytes > 0:
            # the single-copy allreduce if both can read each other's memory (one probe read each; where ptrace
            # rules refuse it, both keep the slot protocol)
            reason = shm_cma.probe(group)
            if reason is not None:
                logger.info("rank %d: no cross-memory allreduce (%s); using the shared-memory slots", setup.rank,
                            reason)
            probed = setup.allgather(b"1" if reason is None else b"0", "setup")
            if all(f == b"1" for f in probed):
                cma = shm_cma.CmaPair(group, setup.cma_bytes)
        return dataclasses.replace(self, shm=group, cma=cma)

    def allreduce(self, backend: RingBackend, flat: np.ndarray, op: ReduceOp, bfloat16: bool, operation: str) -> None:
        """One array: a small one straight to the slots' latency path (``ShmGroup.small``), else as a fused one."""
        shm = self.shm
        assert shm is not None
        if flat.nbytes <= shm.small_bytes and (self.cma is None or flat.nbytes < self.cma.min_bytes):
            shm.small(flat, op, bfloat16, operation, backend._check_peers)
        else:
            self.allreduce_fused(backend, [flat], op, bfloat16, operation)

    def allreduce_fused(self, backend: RingBackend, flats: Sequence[np.ndarray], op: ReduceOp, bfloat16: bool,
                        operation: str) -> None:
        """Cross-memory (two ranks, large arrays) or the shared-memory slots, straight from and into ``flats``."""
        assert self.shm is not None
        if self.cma is not None and self.cma.takes(flats):
            self.cma.allreduce(flats, op, bfloat16, operation, backend._check_peers)
        else:
            self.shm.allreduce(flats, op, bfloat16, operation, backend._check_peers)

    def broadcast(self, backend: RingBackend, flat: np.ndarray, root: int, operation: str) -> None:
        assert self.shm is not None
        self.shm.broadcast([flat], root, operation, backend._check_peers)

    def reducescatter(self, backend: RingBackend, flat: np.ndarray, bounds: Sequence[int], op: ReduceOp,
                      bfloat16: bool, operation: str) -> np.ndarray:
        """The slots' reduce-scatter (``shm_slices``): each rank stages its windows of the other ranks' slices
        straight from ``flat`` and reduces theirs of its own slice into a copy of it; nothing else is copied. Two
        ranks and a large array: the cross-memory pair's reduce-scatter half (``shm_cma``); an array of one small
        block (``ShmGroup.small_bytes``): an allreduce of a copy and a slice (one synchronisation, not two)."""
        assert self.shm is not None
        me = self.shm.local
        if flat.nbytes <= self.shm.small_bytes:  # one small block: the allreduce's one synchronisation is cheaper
            work = flat.copy()
            self.allreduce(backend, work, op, bfloat16, operation)
            return work[bounds[me]:bounds[me + 1]].copy()
        if self.cma is not None and self.cma.takes([flat]):  # two ranks: read the peer's elements of mine directly
            mine = np.empty(bounds[me + 1] - bounds[me], flat.dtype)
            self.cma.reducescatter(flat, mine, bounds[me], op, bfloat16, operation, backend._check_peers)
        else:
            parts = shm_slices.split(flat, bounds, self.shm.size)
            mine = parts[me] = parts[me].copy()
            shm_slices.reduce_scatter_parts(self.shm, parts, op, bfloat16, operation, backend._check_peers)
        if op is ReduceOp.AVERAGE:
            divide_average(mine, backend.size, bfloat16)
        return mine

    def small_allgather(self, backend: RingBackend, payload: bytes, operation: str) -> list[bytes]:
        """One shared-memory round (``shm_slices.allgather_bytes``): no socket to wake up from."""
        assert self.shm is not None
        return shm_slices.allgather_bytes(self.shm, payload, operation, backend._check_peers)

    def allgather(self, backend: RingBackend, raw: np.ndarray, bounds: Sequence[int], operation: str) -> None:
        """The slots' allgather (``shm_slices``): each rank copies its piece in once and every other piece out (two
        ranks and a large array: the cross-memory pair reads the peer's piece straight into ``raw``)."""
        assert self.shm is not None
        if self.cma is not None and self.cma.takes([raw]):  # two ranks: read the peer's piece directly
            self.cma.allgather(raw, bounds, operation, backend._check_peers)
        else:
            shm_slices.allgather(self.shm, raw, bounds, operation, backend._check_peers)

    def barrier(self, backend: RingBackend, operation: str) -> None:
        """One small shared-memory collective, left together (``ShmGroup.barrier``): no socket to wake up from."""
        assert self.shm is not None
        self.shm.barrier(operation, backend._check_peers)

    def leave_together(self) -> None:
        assert self.shm is not None
        self.shm.release()

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()


@dataclass(frozen=True)
class Hierarchical(Plan):
    """Ranks share hosts across several hosts: shared memory within the host, TCP between hosts.

    ``leaders``: local rank 0 of every host, in host order (the TCP ring of the unsplit allreduce); ``cross_rings``:
    with as many ranks on every host, ring i joins local rank i of every host (else empty); ``shm``: this host's
    group, None where this rank is alone on its host."""

    name: ClassVar[str] = "hier"
    scatters_by_allreduce: ClassVar[bool] = True
    local_ranks: tuple[int, ...] = ()
    leaders: tuple[int, ...] = ()
    cross_rings: tuple[tuple[int, ...], ...] = ()
    shm: ShmGroup | None = None

    def build(self, setup: Setup) -> Plan:
        group = _join_shm(setup, self.local_ranks)
        if group is None:
            return TcpRing()
        if len(self.local_ranks) == 1:  # alone on this host: nothing to share (the group took part in the setup)
            group.close()
            group = None
        return dataclasses.replace(self, shm=group)

    def tcp_ring_size(self, backend: RingBackend) -> int:
        return backend.cross_size

    def allreduce(self, backend: RingBackend, flat: np.ndarray, op: ReduceOp, bfloat16: bool, operation: str) -> None:
        """Reduce within the host (shared memory), across hosts between leaders (TCP ring), then share the result
        within the host again; AVERAGE is a SUM divided once, before the sharing. With as many ranks on every host
        and a large array, every local rank carries a slice across hosts (as Horovod's hierarchical allreduce
        does), so the cross-host leg uses every rank's core and connection."""
        inner = ReduceOp.SUM if op is ReduceOp.AVERAGE else op
        shm = self.shm
        if shm is not None and self.cross_rings and flat.nbytes >= HIER_SPLIT_BYTES:
            # each local rank reduces only the slice it carries (reduce-scatter), and the carriers' results are
            # gathered in one pass: (L-1)/L of the array copied in and out per rank, not a full allreduce and L
            # broadcasts; the average is taken once, on the carried slice. Large slices go in pieces, the
            # shared-memory legs overlapping the TCP one (``hier_pipeline``)
            ring = self.cross_rings[backend.local_rank]

            def cross(part: np.ndarray) -> None:
                backend._tcp_allreduce(part, inner, bfloat16, operation, ring)
                if op is ReduceOp.AVERAGE:
                    divide_average(part, backend.size, bfloat16)

            hier_pipeline.allreduce(shm, flat, even_bounds(flat.size, backend.local_size), inner, bfloat16,
                                    operation, cross, backend._check_local_peers, backend.timeout_s,
                                    backend._hier_helper)
            return
        if shm is not None:
            shm.allreduce([flat], inner, bfloat16, operation, backend._check_peers)
        if backend.local_rank == 0:
            backend._tcp_allreduce(flat, inner, bfloat16, operation, self.leaders)
            if op is ReduceOp.AVERAGE:
                divide_average(flat, backend.size, bfloat16)
        if shm is not None:
            shm.broadcast([flat], 0, operation, backend._check_peers)

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()


def choose(rank: int, size: int, host_ids: Sequence[str], shm_everywhere: bool) -> Plan:
    """The plan for this job (its groups not built yet), from every rank's host identity; the same on every rank."""
    if size == 1:
        return Solo()
    hosts = Counter(host_ids)
    if not shm_everywhere or max(hosts.values()) == 1:
        return TcpRing()
    mine = host_ids[rank]
    local_ranks = tuple(r for r, h in enumerate(host_ids) if h == mine)
    if len(hosts) == 1:
        return ShmHost(local_ranks=local_ranks)
    on_host = [[r for r, h in enumerate(host_ids) if h == host] for host in hosts]  # hosts in order of first rank
    leaders = tuple(ranks[0] for ranks in on_host)
    cross_rings: tuple[tuple[int, ...], ...] = ()
    if len({len(ranks) for ranks in on_host}) == 1:
        cross_rings = tuple(tuple(ranks[k] for ranks in on_host) for k in range(len(local_ranks)))
    return Hierarchical(local_ranks=local_ranks, leaders=leaders, cross_rings=cross_rings)


__all__ = ["HIER_SPLIT_BYTES", "Hierarchical", "Plan", "Setup", "ShmHost", "Solo", "TcpRing", "choose", "even_bounds"]
