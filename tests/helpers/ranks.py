"""Test helpers: run a function on N freshly spawned rank processes of one job.

``run_ranks(fn, n)`` starts a ``KVStoreServer`` in the test process, spawns ``n`` processes (multiprocessing
'spawn') whose environment holds everything a launched rank sees (SPARK_HVD_RANK, _SIZE, _RENDEZVOUS, _SECRET,
_JOB_ID, ...), calls ``fn(*args)`` in each and returns the results by rank. A rank that raises makes
``run_ranks`` raise ``RankFailure`` with that rank's traceback; ranks still running after ``timeout`` seconds are
killed and named in a ``TimeoutError``.

``backend_from_env()`` builds a ``RingBackend`` from that environment, for functions that test the backend.
"""

from __future__ import annotations

import glob
import multiprocessing
import multiprocessing.connection
import os
import secrets
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import cloudpickle

from spark_hvd.core.jobenv import JobEnv
from spark_hvd.core.transport.rendezvous import KVStoreServer
from spark_hvd.core.transport.wire import make_secret

EnvSpec = Mapping[str, str] | Callable[[int], Mapping[str, str]] | None


class RankFailure(AssertionError):
    """A rank raised; the message holds its traceback."""

    def __init__(self, rank: int, tb: str) -> None:
        super().__init__(f"rank {rank} failed:\n{tb}")
        self.rank = rank
        self.traceback = tb


@dataclass
class RankDied:
    """Result placeholder of a rank that exited without a result (only for ranks in ``allow_death``)."""

    rank: int
    exitcode: int | None


def _child(payload: bytes, args: tuple, env: dict[str, str], rank: int, conn: Any) -> None:
    os.environ.update(env)
    try:
        fn = cloudpickle.loads(payload)
        result = ("ok", fn(*args))
    except BaseException:
        result = ("error", traceback.format_exc())
    try:
        conn.send(result)
    except Exception:
        conn.send(("error", f"result of rank {rank} could not be sent back:\n{traceback.format_exc()}"))
    conn.close()


def rank_env(rank: int, size: int, address: str, secret: bytes, job_id: str) -> dict[str, str]:
    """The environment a launched rank sees (all ranks on this host)."""
    job = JobEnv(rank=rank, size=size, local_rank=rank, local_size=size, job_id=job_id, secret=secret,
                 rendezvous=address)
    return {**job.to_env(), "OMP_NUM_THREADS": "1"}


def run_ranks(fn: Callable[..., Any], n: int, env: EnvSpec = None, timeout: float = 120.0, args: tuple = (),
              allow_death: set[int] | frozenset[int] = frozenset(), job_id: str | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``n`` spawned ranks of one job and return their results by rank.

    ``env``: extra environment for every rank (a dict) or per rank (a callable ``rank -> dict``).
    ``allow_death``: ranks that may exit without a result (their result is a ``RankDied``).
    """
    job_id = job_id or f"t{secrets.token_hex(4)}"
    secret = make_secret()
    server = KVStoreServer(secret)
    host, port = server.start()
    ctx = multiprocessing.get_context("spawn")
    payload = cloudpickle.dumps(fn)
    procs, conns = [], []
    finished = False
    try:
        for rank in range(n):
            rank_vars = rank_env(rank, n, f"{host}:{port}", secret, job_id)
            extra = env(rank) if callable(env) else (env or {})
            rank_vars.update({k: str(v) for k, v in extra.items()})
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(payload, args, rank_vars, rank, writer),
                               name=f"rank-{rank}", daemon=True)
            proc.start()
            writer.close()
            procs.append(proc)
            conns.append(reader)
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        pending = set(range(n))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"rank(s) {sorted(pending)} of {n} did not finish within {timeout:.0f}s")
            waitables = {conns[r]: r for r in pending}
            waitables.update({procs[r].sentinel: r for r in pending})
            for ready in multiprocessing.connection.wait(list(waitables), timeout=min(left, 1.0)):
                rank = waitables[ready]
                if rank not in pending:
                    continue
                try:
                    status, value = conns[rank].recv()
                except (EOFError, OSError):
                    procs[rank].join(5)
                    if rank in allow_death:
                        results[rank] = RankDied(rank, procs[rank].exitcode)
                        pending.discard(rank)
                        continue
                    raise RankFailure(rank, f"exited with code {procs[rank].exitcode} without a result") from None
                if status == "error":
                    raise RankFailure(rank, value)
                results[rank] = value
                pending.discard(rank)
        finished = True
        return [results[r] for r in range(n)]
    finally:
        for proc in procs:
            proc.join(timeout=10 if finished else 0.1)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in conns:
            conn.close()
        server.stop()


def backend_from_env(backend_kwargs: dict[str, Any] | None = None, **settings: Any):
    """A ``RingBackend`` for this rank from the environment set by ``run_ranks``.

    ``settings`` override fields of ``Settings.from_env()``; ``backend_kwargs`` go to ``RingBackend``
    (e.g. small ``shm_block_bytes`` / ``frame_bytes`` so that small tests cross block and frame boundaries).
    """
    from dataclasses import replace

    from spark_hvd.core.backends.ring import RingBackend
    from spark_hvd.core.settings import Settings
    from spark_hvd.core.transport.rendezvous import KVRendezvous

    cfg = replace(Settings.from_env(), **settings)
    job = JobEnv.from_env()
    rdzv = KVRendezvous(job.rendezvous, job.secret, job.job_id, cfg.timeout_s)
    return RingBackend(job.rank, job.size, rdzv, job.secret, cfg, job.job_id, **(backend_kwargs or {}))


def shm_leftovers(job_id: str) -> list[str]:
    """Shared-memory segments of ``job_id`` still present in /dev/shm (should be none)."""
    return glob.glob(f"/dev/shm/spark_hvd-{job_id}-*")


def shm_groups(name: str, size: int, *, timeout_s: float = 20.0, block_bytes: int = 256, nslots: int = 3) -> list:
    """``size`` members of one ``ShmGroup`` in this process (real /dev/shm segments, names already unlinked): the
    protocol tests run each member on a thread of its own (``on_threads``)."""
    from spark_hvd.core.transport.shm import ShmGroup, segment_path

    nonce = secrets.token_hex(4)
    paths = [segment_path(name, nonce, k) for k in range(size)]
    groups = [ShmGroup(paths, k, list(range(size)), timeout_s, block_bytes, nslots) for k in range(size)]
    for g in groups:
        g.attach()
    for g in groups:
        g.unlink()
    return groups


def on_threads(n: int, fn: Callable[[int], Any]) -> None:
    """Run ``fn(member)`` for members ``0 .. n-1``, one thread each; re-raise the first error."""
    import threading

    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            fn(k)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a member did not finish"
    if errors:
        raise errors[0]
