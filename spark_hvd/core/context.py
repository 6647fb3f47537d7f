"""The process API: ``init()`` joins the job, then collectives go through this process's engine.

One job per process. ``init()`` chooses the backend:

- ``backend=`` a ``Backend`` instance: used as given;
- under ``mpirun`` (``OMPI_COMM_WORLD_SIZE`` / ``PMI_SIZE`` set, no ``SPARK_HVD_RANK``) or ``backend="mpi"``: MPI;
- a launched rank (its ``JobEnv``: ``SPARK_HVD_RANK``/``SPARK_HVD_SIZE`` ..., written by ``spark-hvd-run`` and the
  Spark runner) or ``rank=``/``size=``: the built-in ring (``SPARK_HVD_BACKEND=torch`` or ``backend="torch"``:
  torch.distributed), meeting the other ranks through ``rendezvous`` or the KV service at ``JobEnv.rendezvous``;
- nothing at all (or a size of 1): a single-process job, no sockets.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import pickle
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from spark_hvd.core import process_sets as _ps
from spark_hvd.core.backend import Backend, ReduceOp, Rendezvous
from spark_hvd.core.engine.engine import Engine, GroupHandle, Handle
from spark_hvd.core.errors import AuthenticationError, NotInitializedError
from spark_hvd.core.jobenv import JobEnv, running_job
from spark_hvd.core.process_sets import ProcessSet, global_process_set
from spark_hvd.core.settings import Settings

logger = logging.getLogger(__name__)

_MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


@dataclass
class _Context:
    backend: Backend
    engine: Engine
    settings: Settings
    backend_name: str
    job: JobEnv


_lock = threading.RLock()
_ctx: _Context | None = None
_atexit_registered = False


def _get(what: str) -> _Context:
    ctx = _ctx
    if ctx is None:
        raise NotInitializedError(what)
    return ctx


def _engine(what: str, process_set: ProcessSet | None) -> tuple[Engine, _ps.Member | None]:
    """The engine that runs ``what`` on ``process_set`` (the global one for None / the global set)."""
    ctx = _get(what)
    member = _ps.resolve(process_set, what, ctx.backend.rank)
    return (ctx.engine if member is None else member.engine), member


def _make_backend(*, rendezvous: Rendezvous | None, rank: int | None, size: int | None, backend: Any,
                  secret: bytes | str | None, settings: Settings, job_id: str | None, job: JobEnv | None) -> Backend:
    if isinstance(backend, Backend):
        return backend
    env = os.environ
    name = (backend or env.get("SPARK_HVD_BACKEND") or "").strip().lower() or None
    if name not in (None, "ring", "mpi", "torch", "local"):
        raise ValueError(f"unknown backend {name!r}; expected 'ring', 'mpi', 'torch' or 'local'")
    if rank is None and job is not None:
        rank = job.rank
    if size is None and job is not None:
        size = job.size
    under_mpi = rank is None and any(k in env for k in _MPI_ENV)
    if name == "mpi" or (name is None and under_mpi):
        from spark_hvd.core.backends.mpi_backend import MpiBackend

        return MpiBackend(settings)
    if name == "local" or (rank is None and size is None) or (size == 1 and name != "torch"):
        if size not in (None, 1) or rank not in (None, 0):
            raise ValueError(f"a single-process job has rank 0 of size 1, not rank {rank} of size {size}")
        from spark_hvd.core.backends.local_backend import LocalBackend

        return LocalBackend()
    if rank is None or size is None:
        raise ValueError(f"both rank and size are needed to join a job (got rank={rank}, size={size}); set "
                         "SPARK_HVD_RANK and SPARK_HVD_SIZE or pass rank= and size=")
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a job of size {size}")
    if job_id is None:
        job_id = job.job_id if job is not None else ""
    if secret is None:
        secret = job.secret if job is not None else None
        if secret is None:
            raise AuthenticationError("SPARK_HVD_SECRET is not set and no secret= was given: every rank needs "
                                      "the job's secret to join.")
    elif isinstance(secret, str):
        secret = bytes.fromhex(secret)
    if rendezvous is None:
        address = job.rendezvous if job is not None else None
        if not address:
            raise ValueError("SPARK_HVD_RENDEZVOUS (host:port of the launcher's KV service) is not set and no "
                             f"rendezvous= was given: rank {rank} cannot find the other ranks")
        from spark_hvd.core.transport.rendezvous import KVRendezvous

        rendezvous = KVRendezvous(address, secret, job_id, settings.timeout_s,
                                  encrypt=job is not None and job.encrypt)
    if name == "torch":
        from spark_hvd.core.backends.torch_backend import TorchBackend

        return TorchBackend(rank, size, rendezvous, settings, job_id=job_id, secret=secret, job=job)
    from spark_hvd.core.backends.ring import RingBackend

    return RingBackend(rank, size, rendezvous, secret, settings, job_id, job=job)


def init(*, rendezvous: Rendezvous | None = None, rank: int | None = None, size: int | None = None,
         backend: str | Backend | None = None, secret: bytes | str | None = None, settings: Settings | None = None,
         job_id: str | None = None, process_sets: Sequence[ProcessSet] | None = None) -> None:
    """Join the job (see the module docstring for how the backend is chosen). ``process_sets`` (the same list on
    every rank) are registered as by ``add_process_set``, unless already registered. A second call returns at once,
    unless the engine has stopped on an error (a peer failed or shut down): then the dead engine is shut down and
    the rank joins the job again (every rank must call ``init()`` again, as after ``shutdown()``)."""
    global _ctx, _atexit_registered
    with _lock:
        if _ctx is not None:
            if _ctx.engine.error is None:
                _add_sets(process_sets)
                return
            logger.warning("init(): rank %d's engine stopped on an error (%s); joining the job again",
                           _ctx.backend.rank, _ctx.engine.error)
            shutdown()
        settings = settings or Settings.from_env()
        launched = JobEnv.from_env()  # the launch contract, read here once and passed down
        be = _make_backend(rendezvous=rendezvous, rank=rank, size=size, backend=backend, secret=secret,
                           settings=settings, job_id=job_id, job=launched)
        job = running_job(be, launched)
        try:
            engine = Engine(be, settings, job=job)
        except BaseException:
            be.close()
            raise
        _ctx = _Context(be, engine, settings, getattr(be, "name", type(be).__name__), job)
        _ps.bind(be.rank, be.size)
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True
        logger.debug("spark_hvd initialised: rank %d of %d on the %s backend", be.rank, be.size, _ctx.backend_name)
        _add_sets(process_sets)


def _add_sets(process_sets: Sequence[ProcessSet] | None) -> None:
    for ps in process_sets or ():
        if ps.process_set_id is None:
            add_process_set(ps)


def shutdown() -> None:
    """Leave the job: pending operations fail with ``ShutdownError``; ``init()`` may be called again."""
    global _ctx
    with _lock:
        ctx, _ctx = _ctx, None
        _object_ids.clear()
    if ctx is None:
        return
    _ps.close_all()
    try:
        ctx.engine.shutdown()
    finally:
        ctx.backend.close()


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()``."""
    return _ctx is not None


def rank() -> int:
    """This process's rank in the job (0 .. size-1)."""
    return _get("rank()").backend.rank


def size() -> int:
    """The number of processes in the job."""
    return _get("size()").backend.size


def local_rank() -> int:
    """This process's rank among the processes on its host."""
    return _get("local_rank()").backend.local_rank


def local_size() -> int:
    """The number of processes on this host."""
    return _get("local_size()").backend.local_size


def cross_rank() -> int:
    """This host's index among the job's hosts."""
    return _get("cross_rank()").backend.cross_rank


def cross_size() -> int:
    """The number of hosts in the job."""
    return _get("cross_size()").backend.cross_size


def job_env() -> JobEnv:
    """This rank's launch contract (rank, sizes, job id, GPU ...), its topology as the backend found it."""
    return _get("job_env()").job


def settings() -> Settings:
    """The settings the job runs with."""
    return _get("settings()").settings


def backend_name() -> str:
    """``"ring"``, ``"mpi"``, ``"torch"`` or ``"local"``."""
    return _get("backend_name()").backend_name


def get_engine(process_set: ProcessSet | None = None, what: str = "get_engine()") -> Engine:
    """This process's engine, or its engine of ``process_set`` (a member's; for bindings and tests:
    ``get_engine().stats``); ``what``: the call its errors name (not initialized, not a member)."""
    ctx = _ctx
    if ctx is not None and (process_set is None or process_set is global_process_set):
        return ctx.engine  # (a binding's every call: the job's engine without resolving a set)
    return _engine(what, process_set)[0]


# ---------------------------------------------------------------------- process sets (registration)


class _GlobalRendezvous(Rendezvous):
    """A members-only rendezvous carried by one allgather over the global engine (non-members join that
    allgather with an empty value)."""

    def __init__(self, ranks: Sequence[int], name: str) -> None:
        self.ranks, self.name = list(ranks), name

    def exchange(self, rank: int, size: int, value: bytes) -> list[bytes]:
        values = allgather_object(value, name=self.name)
        return [values[r] for r in self.ranks]


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register ``process_set`` (or a list of ranks) on every rank and return it with its id. Collective over the
    whole job: every rank calls it, in the same order. ``ValueError`` for ranks outside the job or a set with the
    same ranks as one already registered (the global set included). See ``spark_hvd.core.process_sets``."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    size_, me = size(), rank()
    bad = [r for r in ps.ranks if not 0 <= r < size_]
    if bad or not ps.ranks:
        raise ValueError(f"add_process_set: ranks {bad or ps.ranks} are not ranks of a job of size {size_}")
    with _ps.lock:
        set_id = _ps.new_id(ps.ranks, size_)
        secret = broadcast_object(os.urandom(32) if me == 0 else None, 0, name=f"process_set.{set_id}.key")
        rendezvous_name = f"process_set.{set_id}.rendezvous"
        backend = engine_ = None
        if me in ps.ranks:
            from spark_hvd.core.backends.ring import RingBackend
            from spark_hvd.core.engine.device import GroupScope

            set_settings = dataclasses.replace(settings(), timeline=None)  # the global engine owns the file
            job = job_env()
            backend = RingBackend(ps.ranks.index(me), len(ps.ranks), _GlobalRendezvous(ps.ranks, rendezvous_name),
                                  secret, set_settings, f"{job.job_id}.ps{set_id}", job=job)
            try:
                engine_ = Engine(backend, set_settings, GroupScope(set_id, tuple(ps.ranks), job), job=job)
            except BaseException:
                backend.close()
                raise
        else:
            allgather_object(b"", name=rendezvous_name)
        _ps.register(ps, set_id, _ps.Member(list(ps.ranks), backend, engine_))
    logger.debug("rank %d: process set %d (ranks %s) added", me, set_id, ps.ranks)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` on every rank (collective) and close its engine on members. Returns False for
    the global set or a set that is not registered, True otherwise; the object's id becomes None."""
    if process_set.process_set_id is None or process_set.process_set_id == 0 or process_set is global_process_set:
        return False
    member = _ps.unregister(process_set)
    if member is None:
        return False
    barrier()  # every rank has finished with the set before its members close it
    _ps.close(member)
    return True


# ---------------------------------------------------------------------- asynchronous collectives
# ``process_set`` (every collective): run among that set's ranks only (see ``spark_hvd.core.process_sets``); ranks
# are global ranks, averages divide by the set's size. None is the whole job.

_PS = ProcessSet | None  # the process_set= parameter of every collective


def allreduce_async(buf: np.ndarray, name: str | None = None, op: ReduceOp = ReduceOp.AVERAGE,
                    prescale: float = 1.0, postscale: float = 1.0, bfloat16: bool = False,
                    process_set: _PS = None) -> Handle:
    """Reduce ``buf`` across ranks in place; the handle's result is ``buf``."""
    return _engine("allreduce_async()", process_set)[0].enqueue("allreduce", buf, name, op=op, prescale=prescale,
                                                                postscale=postscale, bfloat16=bfloat16)


def grouped_allreduce_async(bufs: Sequence[np.ndarray], names: Sequence[str] | None = None,
                            op: ReduceOp = ReduceOp.AVERAGE, prescale: float = 1.0, postscale: float = 1.0,
                            bfloat16: bool = False, process_set: _PS = None) -> Handle:
    """Reduce several arrays in place; the handle's result is the list of arrays."""
    engine_ = _engine("grouped_allreduce_async()", process_set)[0]
    if names is not None and len(names) != len(bufs):
        raise ValueError(f"grouped allreduce got {len(bufs)} arrays but {len(names)} names")
    handles = [engine_.enqueue("allreduce", b, None if names is None else names[i], op=op, prescale=prescale,
                               postscale=postscale, bfloat16=bfloat16) for i, b in enumerate(bufs)]
    return GroupHandle("grouped_allreduce", handles)


def allgather_async(buf: np.ndarray, name: str | None = None, process_set: _PS = None) -> Handle:
    """Concatenate every rank's ``buf`` along the first dimension; the result is a new array."""
    return _engine("allgather_async()", process_set)[0].enqueue("allgather", buf, name)


def broadcast_async(buf: np.ndarray, root_rank: int, name: str | None = None, process_set: _PS = None) -> Handle:
    """Overwrite ``buf`` with ``root_rank``'s (a global rank) in place; the result is ``buf``."""
    engine_, member = _engine("broadcast_async()", process_set)
    return engine_.enqueue("broadcast", buf, name, root=_ps.set_root(member, root_rank, "broadcast_async()"))


def alltoall_async(buf: np.ndarray, splits: Sequence[int] | None = None, name: str | None = None,
                   process_set: _PS = None) -> Handle:
    """Send ``splits[i]`` rows to the i-th rank of the set (even split when None); result
    ``(array, recv_splits)``."""
    return _engine("alltoall_async()", process_set)[0].enqueue("alltoall", buf, name, splits=splits)


def reducescatter_async(buf: np.ndarray, op: ReduceOp = ReduceOp.AVERAGE, name: str | None = None,
                        prescale: float = 1.0, postscale: float = 1.0, process_set: _PS = None) -> Handle:
    """Reduce ``buf`` across ranks and return this rank's rows (the first ``rows % size`` ranks get one more);
    ``prescale`` multiplies each rank's input before the reduction, ``postscale`` the result after it."""
    return _engine("reducescatter_async()", process_set)[0].enqueue("reducescatter", buf, name, op=op,
                                                                    prescale=prescale, postscale=postscale)


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle`` and return its result (raises the operation's error)."""
    return handle.wait()


def poll(handle: Handle) -> bool:
    """True when ``handle`` has finished; never blocks."""
    return handle.done()


# ---------------------------------------------------------------------- blocking forms


def allreduce(buf: np.ndarray, name: str | None = None, op: ReduceOp = ReduceOp.AVERAGE, prescale: float = 1.0,
              postscale: float = 1.0, bfloat16: bool = False, process_set: _PS = None) -> np.ndarray:
    """Blocking ``allreduce_async`` (in place; returns ``buf``).

    The calling thread runs the negotiation round and the collective itself when the engine thread is not in a
    round (no hand-off between threads), so a small allreduce costs about what the backend's own does.
    """
    return _engine("allreduce()", process_set)[0].allreduce(buf, name, op=op, prescale=prescale, postscale=postscale,
                                                           bfloat16=bfloat16)


def grouped_allreduce(bufs: Sequence[np.ndarray], names: Sequence[str] | None = None,
                      op: ReduceOp = ReduceOp.AVERAGE, prescale: float = 1.0, postscale: float = 1.0,
                      bfloat16: bool = False, process_set: _PS = None) -> list[np.ndarray]:
    """Blocking ``grouped_allreduce_async``."""
    return grouped_allreduce_async(bufs, names, op, prescale, postscale, bfloat16, process_set).wait()


def allgather(buf: np.ndarray, name: str | None = None, process_set: _PS = None) -> np.ndarray:
    """Blocking ``allgather_async``."""
    return _engine("allgather()", process_set)[0].enqueue("allgather", buf, name, start_engine=False).wait()


def broadcast(buf: np.ndarray, root_rank: int, name: str | None = None, process_set: _PS = None) -> np.ndarray:
    """Blocking ``broadcast_async`` (in place; returns ``buf``)."""
    engine_, member = _engine("broadcast()", process_set)
    return engine_.enqueue("broadcast", buf, name, root=_ps.set_root(member, root_rank, "broadcast()"),
                           start_engine=False).wait()


def alltoall(buf: np.ndarray, splits: Sequence[int] | None = None, name: str | None = None,
             process_set: _PS = None) -> tuple[np.ndarray, list[int]]:
    """Blocking ``alltoall_async``."""
    return alltoall_async(buf, splits, name, process_set).wait()


def reducescatter(buf: np.ndarray, op: ReduceOp = ReduceOp.AVERAGE, name: str | None = None,
                  prescale: float = 1.0, postscale: float = 1.0, process_set: _PS = None) -> np.ndarray:
    """Blocking ``reducescatter_async``."""
    return reducescatter_async(buf, op, name, prescale, postscale, process_set).wait()


def barrier(process_set: _PS = None) -> None:
    """Return once every rank (of ``process_set``) has called ``barrier()``."""
    _engine("barrier()", process_set)[0].barrier()


def join() -> int:
    """Declare this rank out of data and wait for the others.

    Until every rank has joined, this rank's engine keeps taking part in the other ranks' collectives,
    contributing the identity of each reduction (zeros for sum and average). Returns the last rank to join.
    """
    return _get("join()").engine.join().wait()


def broadcast_object(obj: Any = None, root_rank: int = 0, name: str | None = None, process_set: _PS = None) -> Any:
    """Send a picklable object from ``root_rank`` (a global rank) to every rank (of the set) and return it."""
    ctx = _get("broadcast_object()")
    engine_, member = _engine("broadcast_object()", process_set)
    root = _ps.set_root(member, root_rank, "broadcast_object()")
    base = name or f"broadcast_object.noname.{_next_object_id('broadcast', process_set)}"
    if ctx.backend.rank == root_rank:
        payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8).copy()
        length = np.array([payload.size], dtype=np.int64)
    else:
        payload = None
        length = np.zeros(1, dtype=np.int64)
    engine_.enqueue("broadcast", length, f"{base}.len", root=root).wait()
    if payload is None:
        payload = np.empty(int(length[0]), dtype=np.uint8)
    engine_.enqueue("broadcast", payload, f"{base}.data", root=root).wait()
    return obj if ctx.backend.rank == root_rank else pickle.loads(payload.tobytes())


def allgather_object(obj: Any, name: str | None = None, process_set: _PS = None) -> list[Any]:
    """Gather a picklable object from every rank (of the set); returns the list indexed by (set) rank."""
    engine_ = _engine("allgather_object()", process_set)[0]
    base = name or f"allgather_object.noname.{_next_object_id('allgather', process_set)}"
    payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    lengths = engine_.enqueue("allgather", np.array([payload.size], dtype=np.int64), f"{base}.len").wait()
    data = engine_.enqueue("allgather", payload, f"{base}.data").wait().tobytes()
    out, offset = [], 0
    for n in lengths.tolist():
        out.append(pickle.loads(data[offset:offset + n]))
        offset += n
    return out


_object_ids: dict[tuple[str, int], int] = {}


def _next_object_id(kind: str, process_set: _PS = None) -> int:
    """Per kind and set, so unnamed object collectives of one set keep the same names on its members."""
    key = (kind, 0 if process_set is None else int(process_set.process_set_id or 0))
    with _lock:
        n = _object_ids.get(key, 0)
        _object_ids[key] = n + 1
        return n
