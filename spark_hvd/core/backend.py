"""The one interface every collective backend implements (built-in ring, MPI, torch.distributed).

Backends work on contiguous numpy arrays and are driven by one thread at a time (the engine's background
thread), so they need no locking of their own. The engine never asks which backend it has.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

import numpy as np


class ReduceOp(enum.Enum):
    """Reduction of an allreduce / reducescatter (Horovod names: hvd.Average, hvd.Sum, ...)."""

    AVERAGE = "average"
    SUM = "sum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    #: adaptive summation of gradients (``spark_hvd.core.algorithms.adasum``): allreduce of floating-point host arrays
    #: only
    ADASUM = "adasum"


# Horovod's names for the reductions (``hvd.Average``, ``hvd.Sum`` ...), defined here once; the core and both
# bindings re-export them.
Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM


class Backend(ABC):
    """Collectives over the ranks of one job.

    Topology attributes: ``rank``, ``size``, ``local_rank``, ``local_size`` (ranks on this host),
    ``cross_rank``, ``cross_size`` (this host's index among hosts, number of hosts).

    All methods are blocking and collective: every rank calls them in the same order with matching
    arguments. A peer that dies or does not answer within the timeout raises ``PeerFailureError`` naming it.
    ``bfloat16`` arrives as a ``uint16`` view with ``bfloat16=True`` passed to the reducing calls.
    """

    name: str = "abstract"
    #: True when ``allreduce_fused`` reduces the arrays where they lie, with no fusion buffer (shared-memory
    #: staging slots, or nothing to move at all): the engine then hands it a whole round's tensors at once, since
    #: the fusion threshold only bounds a fusion buffer. Otherwise the engine packs its own reusable buffer.
    fuses_in_place: bool = False
    #: True when ``allreduce_agreed`` carries the ranks' agreement inside the data collective (two ranks over
    #: TCP, ``spark_hvd.core.algorithms.agreed``): a speculative round of one large tensor then needs no separate
    #: exchange.
    agrees_in_band: bool = False
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int

    @abstractmethod
    def allreduce(self, buf: np.ndarray, op: ReduceOp, *, bfloat16: bool = False) -> None:
        """Reduce ``buf`` element-wise across ranks, in place (AVERAGE divides the sum by ``size``)."""

    def allreduce_fused(self, bufs: Sequence[np.ndarray], op: ReduceOp, *, bfloat16: bool = False) -> None:
        """Allreduce several arrays of one dtype as one collective, in place.

        The default packs them into one temporary array; backends with a staging area of their own
        (shared memory) override it to pack straight into that area and save a copy each way.
        """
        if not bufs:
            return
        flat = np.concatenate([b.reshape(-1) for b in bufs])
        self.allreduce(flat, op, bfloat16=bfloat16)
        offset = 0
        for b in bufs:
            n = b.size
            b.reshape(-1)[...] = flat[offset:offset + n]
            offset += n

    def allreduce_agreed(self, buf: np.ndarray, op: ReduceOp, agree: bool) -> bool:
        """Allreduce ``buf`` in place if every rank ``agree``s, and say whether they all did; on False no rank's
        ``buf`` changed. With ``agree`` False, ``buf`` is only a template (size and dtype), never read or written.
        Only where ``agrees_in_band``, or for arrays within ``agrees_small``."""
        raise NotImplementedError(f"the {self.name} backend carries no agreement in band")

    def agrees_small(self, dtype: np.dtype, op: ReduceOp) -> int:
        """Arrays of ``dtype`` up to this many bytes go through ``allreduce_agreed`` with ``op`` among any number of
        ranks as one small collective, the agreement in band (every rank on one host's shared memory); 0: none. The
        same on every rank of the job."""
        return 0

    def tunables(self) -> dict[str, int]:
        """This backend's own settings that autotune may search here, by ``Settings`` field, with their current
        values; {} when none applies (the ring: ``halving_doubling_bytes`` where its TCP allreduces run among three
        or more ranks or hosts). The engine never reads a backend's fields for this."""
        return {}

    def apply_tuning(self, values: Mapping[str, int]) -> None:
        """Run with these values of ``tunables()``'s settings from the next collective on (every rank applies the
        same values in the same round, between collectives)."""
        if values:
            raise ValueError(f"the {self.name} backend has no tunable setting {sorted(values)}")

    @abstractmethod
    def allgather(self, buf: np.ndarray) -> np.ndarray:
        """Concatenate every rank's ``buf`` along the first dimension (which may differ by rank)."""

    @abstractmethod
    def broadcast(self, buf: np.ndarray, root: int) -> None:
        """Overwrite ``buf`` on every rank with root's ``buf``, in place."""

    @abstractmethod
    def alltoall(self, buf: np.ndarray, splits: Sequence[int] | None = None) -> tuple[np.ndarray, list[int]]:
        """Send ``splits[i]`` first-dimension rows of ``buf`` to rank i (even split when None).

        Returns the rows received, concatenated in rank order, and how many came from each rank.
        """

    @abstractmethod
    def reducescatter(self, buf: np.ndarray, op: ReduceOp, *, bfloat16: bool = False) -> np.ndarray:
        """Reduce ``buf`` across ranks and return this rank's part of the first dimension.

        Rows are split as evenly as possible, the first ``rows % size`` ranks getting one row more.
        """

    @abstractmethod
    def barrier(self) -> None:
        """Return once every rank has called it."""

    def leave_together(self) -> None:  # noqa: B027 - nothing to wait for by default
        """Called after a collective that completes a barrier (a speculative round's flag): wait, briefly and
        without failing, until every peer has finished it too, so the ranks leave the barrier together and the
        next collective starts on every rank at once. Moves nothing; by default it returns at once."""

    @abstractmethod
    def close(self) -> None:
        """Release sockets, shared memory and threads. Safe to call twice."""


def as_rows(buf: np.ndarray) -> np.ndarray:
    """``buf`` as a C-contiguous array of at least one dimension (a scalar becomes one row), copied only if needed."""
    buf = np.ascontiguousarray(buf)
    return buf.reshape(1) if buf.ndim == 0 else buf


def alltoall_args(buf: np.ndarray, splits: Sequence[int] | None, size: int) -> tuple[np.ndarray, list[int]]:
    """An alltoall's arguments in the form every backend sends: ``(contiguous buf, splits)``.

    ``buf`` becomes C-contiguous with at least one dimension (a scalar is one row); ``splits`` becomes ``size``
    ints, the rows for each rank, or an even split of the rows when it is None. Raises ``ValueError`` when the rows
    do not divide evenly, or the splits are not ``size`` non-negative counts summing to the rows.
    """
    buf = as_rows(buf)
    rows = buf.shape[0]
    if splits is None:
        if rows % size:
            raise ValueError(f"alltoall without splits needs rows divisible by {size}, got {rows}")
        return buf, [rows // size] * size
    counts = [int(s) for s in splits]
    if len(counts) != size or any(c < 0 for c in counts) or sum(counts) != rows:
        raise ValueError(f"alltoall splits {counts} must be {size} non-negative row counts summing to {rows}")
    return buf, counts


def rank_rows(rows: int, size: int, rank: int) -> slice:
    """The rows of ``rank`` when ``rows`` are split as evenly as possible, the first ``rows % size`` ranks getting
    one more (the reducescatter split)."""
    base, extra = divmod(rows, size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def reducescatter_by_allreduce(backend: Backend, buf: np.ndarray, op: ReduceOp, *,
                               bfloat16: bool = False) -> np.ndarray:
    """``backend.reducescatter`` for backends without a native one: allreduce a copy of ``buf`` (a scalar is one
    row) and return this rank's rows of it (``rank_rows``) as a new contiguous array."""
    work = np.array(buf, copy=True)
    if work.ndim == 0:
        work = work.reshape(1)
    backend.allreduce(work, op, bfloat16=bfloat16)
    return np.ascontiguousarray(work[rank_rows(work.shape[0], backend.size, backend.rank)])


class Rendezvous(ABC):
    """How the ranks of a job find each other (pluggable: launcher KV service, the Spark driver service's KV
    table, static list)."""

    @abstractmethod
    def exchange(self, rank: int, size: int, value: bytes) -> list[bytes]:
        """Publish this rank's ``value`` and return every rank's value, indexed by rank."""
