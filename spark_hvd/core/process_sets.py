"""Process sets: collectives restricted to a subset of the job's ranks (Horovod's ``hvd.ProcessSet``).

``add_process_set(ranks)`` is collective over every rank of the job, called in the same order everywhere. It
gives the set the next id and, on the members only, a core context of its own: a ``RingBackend`` joined through
the global engine (the members' addresses are allgathered over the job's own authenticated ring, under a fresh
secret broadcast by rank 0 and the job id ``<job>.ps<id>``) and an ``Engine`` on it. Non-members keep only the id
and the ranks. The global set (id 0) is the job itself: its engine is the one ``init()`` made.

Device tensors on a set (CUDA tensors; CPU torch tensors under the gloo stand-in) are reduced where they lie by a
device group of the set's members only, which the set's engine opens at its first device collective (nothing is
opened for a set that never reduces one) and closes when the set is removed (``spark_hvd.core.device``).

Semantics follow Horovod: ranks are global ranks everywhere (a broadcast's ``root_rank`` too); averages divide by
the set's size; a rank outside a set that calls a collective on it gets ``ValueError``; ``remove_process_set`` is
collective as well and returns False for the global set or a set already removed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from spark_hvd.core.backend import Backend, Rendezvous

logger = logging.getLogger(__name__)


class ProcessSet:
    """A set of global ranks that run collectives together. Register it with ``add_process_set`` (or
    ``init(process_sets=[...])``) on every rank; then pass it as ``process_set=`` to a collective."""

    def __init__(self, ranks: Iterable[int]) -> None:
        if hasattr(ranks, "Get_group") or hasattr(ranks, "Get_rank"):  # an mpi4py communicator
            raise TypeError(
                "ProcessSet(mpi_comm) is not supported: spark_hvd's process sets are lists of global ranks (a job "
                "need not run under MPI). Pass the ranks instead, e.g. ProcessSet([0, 2]); under mpirun, "
                "comm.Get_group().Translate_ranks(list(range(comm.Get_size())), MPI.COMM_WORLD.Get_group()) "
                "gives a communicator's ranks in COMM_WORLD.")
        if not isinstance(ranks, Iterable):
            raise TypeError(f"ProcessSet needs a list of integer ranks, got {type(ranks).__name__} {ranks!r}")
        ranks = list(ranks)
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(f"ProcessSet needs a list of integer ranks, got {ranks!r}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks must be distinct, got {ranks!r}")
        self.ranks: list[int] = sorted(ranks)
        self.process_set_id: int | None = None

    def _invalidate(self) -> None:
        self.process_set_id = None

    def included(self) -> bool | None:
        """Whether this rank belongs to the set (None before ``init()``)."""
        from spark_hvd.core import context

        if not context.is_initialized():
            return None
        return context.rank() in _ranks_of(self)

    def size(self) -> int | None:
        """The number of ranks in the set (None while the set is not registered)."""
        if self.process_set_id is None:
            return None
        return len(_ranks_of(self))

    def rank(self) -> int | None:
        """This rank's index in the set (None while the set is not registered); ``ValueError`` for a non-member.
        Collectives still take global ranks (``root_rank=``), as in Horovod."""
        from spark_hvd.core import context

        if self.process_set_id is None:
            return None
        ranks, me = _ranks_of(self), context.rank()
        if me not in ranks:
            raise ValueError(f"rank {me} is not a member of process set {self.process_set_id} (ranks {ranks})")
        return ranks.index(me)

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


#: The whole job (id 0); its ranks are filled in by ``init()``.
global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


@dataclass
class _Member:
    """What a registered set holds on this rank: its ranks, and its backend and engine on members."""

    ranks: list[int]
    backend: Backend | None
    engine: Any  # spark_hvd.core.engine.Engine on members, None elsewhere


_lock = threading.RLock()
_sets: dict[int, _Member] = {}
_next_id = 1


def _ranks_of(ps: ProcessSet) -> list[int]:
    if ps.process_set_id == 0 or ps is global_process_set:
        from spark_hvd.core import context

        return list(range(context.size()))
    member = _sets.get(ps.process_set_id) if ps.process_set_id is not None else None
    return member.ranks if member is not None else ps.ranks


def resolve(process_set: ProcessSet | None, what: str, my_rank: int) -> _Member | None:
    """The registered set ``process_set`` names on this rank, or None for the global set. ``ValueError`` when it
    is not registered or this rank is not a member (naming the rank and the set)."""
    if process_set is None or process_set is global_process_set or process_set.process_set_id == 0:
        return None
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{what}: process_set must be a ProcessSet, got {type(process_set).__name__}")
    member = _sets.get(process_set.process_set_id) if process_set.process_set_id is not None else None
    if member is None:
        raise ValueError(f"{what}: {process_set} is not registered on rank {my_rank}; call add_process_set() on "
                         "every rank first (or it was removed)")
    if member.engine is None:
        raise ValueError(f"{what}: rank {my_rank} is not a member of the provided process set "
                         f"{process_set.process_set_id} (ranks {member.ranks})")
    return member


def set_root(member: _Member | None, root_rank: int, what: str) -> int:
    """A global ``root_rank`` as the set's own rank; ``ValueError`` when the root is not in the set."""
    if member is None:
        return root_rank
    if root_rank not in member.ranks:
        raise ValueError(f"{what}: root_rank {root_rank} is not in the process set (ranks {member.ranks})")
    return member.ranks.index(root_rank)


class _GlobalRendezvous(Rendezvous):
    """A members-only rendezvous carried by one allgather over the global engine (non-members join that
    allgather with an empty value through :func:`_gather`)."""

    def __init__(self, ranks: Sequence[int], name: str) -> None:
        self.ranks, self.name = list(ranks), name

    def exchange(self, rank: int, size: int, value: bytes) -> list[bytes]:
        values = _gather(value, self.name)
        return [values[r] for r in self.ranks]


def _gather(value: bytes, name: str) -> list[bytes]:
    from spark_hvd.core import context

    return context.allgather_object(value, name=name)


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register ``process_set`` (or a list of ranks) on every rank and return it with its id. Collective over the
    whole job: every rank calls it, in the same order. ``ValueError`` for ranks outside the job or a set with the
    same ranks as one already registered (the global set included)."""
    global _next_id
    from spark_hvd.core import context

    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    size, me = context.size(), context.rank()
    bad = [r for r in ps.ranks if not 0 <= r < size]
    if bad or not ps.ranks:
        raise ValueError(f"add_process_set: ranks {bad or ps.ranks} are not ranks of a job of size {size}")
    with _lock:
        if ps.ranks == list(range(size)) or any(m.ranks == ps.ranks for m in _sets.values()):
            raise ValueError(f"Attempted to add a duplicate process set: {ps}")
        set_id, _next_id = _next_id, _next_id + 1
        secret = context.broadcast_object(os.urandom(32) if me == 0 else None, 0, name=f"process_set.{set_id}.key")
        rendezvous_name = f"process_set.{set_id}.rendezvous"
        backend = engine = None
        if me in ps.ranks:
            from spark_hvd.core.device import GroupScope
            from spark_hvd.core.engine import Engine
            from spark_hvd.core.ring import RingBackend

            settings = dataclasses.replace(context.settings(), timeline=None)  # the global engine owns the file
            job = context.job_env()
            backend = RingBackend(ps.ranks.index(me), len(ps.ranks), _GlobalRendezvous(ps.ranks, rendezvous_name),
                                  secret, settings, f"{job.job_id}.ps{set_id}")
            try:
                engine = Engine(backend, settings, GroupScope(set_id, tuple(ps.ranks), job))
            except BaseException:
                backend.close()
                raise
        else:
            _gather(b"", rendezvous_name)
        _sets[set_id] = _Member(list(ps.ranks), backend, engine)
        ps.process_set_id = set_id
    logger.debug("rank %d: process set %d (ranks %s) added", me, set_id, ps.ranks)
    return ps


def _close(member: _Member) -> None:
    try:
        if member.engine is not None:
            member.engine.shutdown()
    finally:
        if member.backend is not None:
            member.backend.close()


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` on every rank (collective) and close its engine on members. Returns False for
    the global set or a set that is not registered, True otherwise; the object's id becomes None."""
    from spark_hvd.core import context

    set_id = process_set.process_set_id
    if set_id is None or set_id == 0:
        return False
    with _lock:
        member = _sets.pop(set_id, None)
    process_set._invalidate()
    if member is None:
        return False
    context.barrier()  # every rank has finished with the set before its members close it
    _close(member)
    return True


def close_all() -> None:
    """Close every registered set on this rank (``shutdown()``); ids start again from 1."""
    global _next_id
    with _lock:
        members, _next_id = list(_sets.values()), 1
        _sets.clear()
    for member in members:
        try:
            _close(member)
        except Exception:  # shutting down: a broken set must not stop the others from closing
            logger.warning("closing a process set failed", exc_info=True)
