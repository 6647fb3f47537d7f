"""Process sets: collectives restricted to a subset of the job's ranks (Horovod's ``hvd.ProcessSet``).

``add_process_set(ranks)`` is collective over every rank of the job, called in the same order everywhere. It
gives the set the next id and, on the members only, a core context of its own: a ``RingBackend`` joined through
the global engine (the members' addresses are allgathered over the job's own authenticated ring, under a fresh
secret broadcast by rank 0 and the job id ``<job>.ps<id>``) and an ``Engine`` on it. Non-members keep only the id
and the ranks. The global set (id 0) is the job itself: its engine is the one ``init()`` made.

Device tensors on a set (CUDA tensors; CPU torch tensors under the gloo stand-in) are reduced where they lie by a
device group of the set's members only, which the set's engine opens at its first device collective (nothing is
opened for a set that never reduces one) and closes when the set is removed (``spark_hvd.core.engine.device``).

Semantics follow Horovod: ranks are global ranks everywhere (a broadcast's ``root_rank`` too); averages divide by
the set's size; a rank outside a set that calls a collective on it gets ``ValueError``; ``remove_process_set`` is
collective as well and returns False for the global set or a set already removed.

This module is the registry (which sets exist, which ranks and engine each has on this rank); the collective
registration itself (``add_process_set`` / ``remove_process_set``) lives with the process API in
``spark_hvd.core.context``, which tells the registry the job it belongs to (:func:`bind`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from spark_hvd.core.backend import Backend
from spark_hvd.core.errors import NotInitializedError

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
        if _world is None:
            return None
        return _world[0] in _ranks_of(self)

    def size(self) -> int | None:
        """The number of ranks in the set (None while the set is not registered)."""
        if self.process_set_id is None:
            return None
        return len(_ranks_of(self))

    def rank(self) -> int | None:
        """This rank's index in the set (None while the set is not registered); ``ValueError`` for a non-member.
        Collectives still take global ranks (``root_rank=``), as in Horovod."""
        if self.process_set_id is None:
            return None
        ranks, me = _ranks_of(self), _joined("rank()")[0]
        if me not in ranks:
            raise ValueError(f"rank {me} is not a member of process set {self.process_set_id} (ranks {ranks})")
        return ranks.index(me)

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


#: The whole job (id 0); its ranks are filled in by ``init()``.
global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


@dataclass
class Member:
    """What a registered set holds on this rank: its ranks, and its backend and engine on members."""

    ranks: list[int]
    backend: Backend | None
    engine: Any  # spark_hvd.core.engine.engine.Engine on members, None elsewhere


#: held while a set is registered or removed (a registration is collective: it spans the whole exchange)
lock = threading.RLock()
_sets: dict[int, Member] = {}
_next_id = 1
_world: tuple[int, int] | None = None  # (rank, size) of the job this process has joined


def bind(rank: int, size: int) -> None:
    """The job this process has joined (``init()``): the global set's ranks and this rank's place in them."""
    global _world
    _world = (rank, size)


def _joined(what: str) -> tuple[int, int]:
    if _world is None:
        raise NotInitializedError(what)
    return _world


def _ranks_of(ps: ProcessSet) -> list[int]:
    if ps.process_set_id == 0 or ps is global_process_set:
        return list(range(_joined("size()")[1]))
    member = _sets.get(ps.process_set_id) if ps.process_set_id is not None else None
    return member.ranks if member is not None else ps.ranks


def resolve(process_set: ProcessSet | None, what: str, my_rank: int) -> Member | None:
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


def set_root(member: Member | None, root_rank: int, what: str) -> int:
    """A global ``root_rank`` as the set's own rank; ``ValueError`` when the root is not in the set."""
    if member is None:
        return root_rank
    if root_rank not in member.ranks:
        raise ValueError(f"{what}: root_rank {root_rank} is not in the process set (ranks {member.ranks})")
    return member.ranks.index(root_rank)


def new_id(ranks: list[int], size: int) -> int:
    """The id the next set (of ``ranks``, in a job of ``size``) gets; ``ValueError`` for a duplicate of a set
    already registered (the global set included). Call it holding :data:`lock`."""
    global _next_id
    if ranks == list(range(size)) or any(m.ranks == ranks for m in _sets.values()):
        raise ValueError(f"Attempted to add a duplicate process set: {ProcessSet(ranks)}")
    set_id, _next_id = _next_id, _next_id + 1
    return set_id


def register(ps: ProcessSet, set_id: int, member: Member) -> None:
    """Record ``ps`` under ``set_id`` with what this rank holds of it."""
    with lock:
        _sets[set_id] = member
        ps.process_set_id = set_id


def unregister(ps: ProcessSet) -> Member | None:
    """Forget ``ps`` (its id becomes None); what this rank held of it, or None when it was not registered."""
    with lock:
        member = _sets.pop(ps.process_set_id, None) if ps.process_set_id else None
    ps._invalidate()
    return member


def close(member: Member) -> None:
    """Stop a set's engine and close its backend (on a member; nothing to do elsewhere)."""
    try:
        if member.engine is not None:
            member.engine.shutdown()
    finally:
        if member.backend is not None:
            member.backend.close()


def close_all() -> None:
    """Close every registered set on this rank (``shutdown()``); ids start again from 1."""
    global _next_id, _world
    with lock:
        members, _next_id, _world = list(_sets.values()), 1, None
        _sets.clear()
    for member in members:
        try:
            close(member)
        except Exception:  # shutting down: a broken set must not stop the others from closing
            logger.warning("closing a process set failed", exc_info=True)
