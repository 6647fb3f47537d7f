"""``KVTorchStore``: a ``torch.distributed.Store`` over spark_hvd's authenticated KV service.

It is the rendezvous of every torch.distributed group spark_hvd opens: the device group (NCCL, or gloo standing in,
``spark_hvd.core.engine.torch_device``) and the ``SPARK_HVD_BACKEND=torch`` backend. ``open_store`` picks the service:

- the launcher's KV service (``JobEnv.rendezvous``, or the address of the ``KVRendezvous`` the ranks met through);
- else the Spark runner's driver service (``JobEnv.service_address``), which serves the same operations
  (``spark_hvd.core.transport.rendezvous.KVTable``) to a connection whose hello says ``"kv"``.

Both are already there for the job: spark_hvd opens no port for torch.distributed's rendezvous, and every
connection to them proves the job's secret with a fresh challenge (``spark_hvd.core.transport.wire``), so a client
without the secret can neither read nor write a key. A job of one process uses a ``HashStore``. Only where a job has
neither service (ranks joined through a custom ``rendezvous=`` without a launcher, or ``mpirun``) does rank 0 start a
``KVStoreServer`` of its own (on the address a ring rank would listen on, ``spark_hvd.core.transport.addresses``),
authenticated like the others, and publish its address through the job's own rendezvous or backend; under
``mpirun`` (no job secret) a fresh secret travels with it over MPI. Never a TCPStore.

Keys live under ``<job id>/torch/<attempt>/<name>/<generation>/``: rank 0 numbers the groups of that name in the
job (an ``init()`` after a ``shutdown()`` gets a fresh generation) and publishes the number through the job's own
rendezvous or backend, so every rank of a group uses the same keys and two groups never collide.

torch (2.13) forwards ``set``, ``get``, ``add``, ``compare_set``, ``wait`` and ``check`` from its own stores
(``PrefixStore``) to a Python store; ``delete_key`` and ``num_keys`` are here for direct callers. The timeout is
the ``Store`` base's (``timeout`` / ``set_timeout``). torch is imported on first use, as everywhere in ``core``:
the methods live in ``_KVStoreOps`` and ``kv_store_class()`` joins them with ``torch.distributed.Store``
(``KVTorchStore``, the module's attribute, is that class).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from spark_hvd.core.jobenv import JobEnv
from spark_hvd.core.transport.addresses import listen_address, meeting_host
from spark_hvd.core.transport.rendezvous import KVClient, KVStoreServer
from spark_hvd.core.transport.wire import make_secret


def _timeout_error(message: str) -> Exception:
    import torch.distributed as dist

    return getattr(dist, "DistStoreError", RuntimeError)(message)


@functools.cache
def kv_store_class() -> type:
    """``KVTorchStore``: ``_KVStoreOps`` on ``torch.distributed.Store`` (torch is imported here, on first use)."""
    import torch.distributed as dist

    return type("KVTorchStore", (_KVStoreOps, dist.Store), {"__module__": __name__, "__doc__": _KVStoreOps.__doc__})


def __getattr__(name: str) -> Any:
    if name == "KVTorchStore":
        return kv_store_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _KVStoreOps:
    """A ``torch.distributed.Store`` whose keys live in a spark_hvd KV service, under ``prefix``.

    Each thread that uses the store gets its own authenticated connection (torch may call from its own threads).
    ``server`` is a ``KVStoreServer`` this store owns (the fallback of ``open_store``), stopped by ``close``.
    ``encrypt``: the connections encrypt their frames, as the service does (``JobEnv.encrypt``).
    """

    def __init__(self, address: str, secret: bytes, prefix: str, timeout: timedelta,
                 hello: tuple[Any, ...] | None = None, server: KVStoreServer | None = None,
                 encrypt: bool = False) -> None:
        super().__init__()  # torch.distributed.Store's (see kv_store_class)
        self.set_timeout(timeout)
        self.address, self.prefix = address, prefix
        self._secret, self._hello, self._server, self._encrypt = secret, hello, server, encrypt
        self._local = threading.local()
        self._clients: list[KVClient] = []
        self._lock = threading.Lock()

    def _kv(self) -> KVClient:
        client = getattr(self._local, "client", None)
        if client is None:
            client = KVClient(self.address, self._secret, self.timeout.total_seconds(), hello=self._hello,
                              encrypt=self._encrypt)
            self._local.client = client
            with self._lock:
                self._clients.append(client)
        return client

    def _key(self, key: str) -> str:
        return self.prefix + key

    def _waited(self, keys: Sequence[str], timeout: timedelta | None) -> None:
        seconds = (self.timeout if timeout is None else timeout).total_seconds()
        missing = self._kv().wait([self._key(k) for k in keys], seconds)
        if missing:
            names = [k[len(self.prefix):] for k in missing]
            raise _timeout_error(f"spark_hvd KV store at {self.address}: key(s) {names} not set within "
                                 f"{seconds:.0f}s (a rank of the group did not arrive)")

    # -- torch.distributed.Store -------------------------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        """Store ``value`` under ``key`` (overwrites)."""
        self._kv().set(self._key(key), value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting for it up to the store's timeout."""
        seconds = self.timeout.total_seconds()
        found = self._kv().get_many([self._key(key)], seconds)
        if not found:
            raise _timeout_error(f"spark_hvd KV store at {self.address}: key {key!r} not set within "
                                 f"{seconds:.0f}s (a rank of the group did not arrive)")
        return found[self._key(key)]

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer at ``key``; the new value."""
        return self._kv().add(self._key(key), amount)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """torch's compare-and-set: ``desired`` if it was set, else the current value."""
        def raw(v: bytes | str) -> bytes:
            return v.encode() if isinstance(v, str) else bytes(v)

        return self._kv().compare_set(self._key(key), raw(expected), raw(desired))

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Until every key is set; a ``DistStoreError`` naming the missing ones after the timeout."""
        self._waited(keys, timeout)

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key is set, now."""
        return self._kv().check([self._key(k) for k in keys])

    def delete_key(self, key: str) -> bool:
        """Remove ``key``; whether it was set."""
        return self._kv().delete_key(self._key(key))

    def num_keys(self) -> int:
        """How many keys this store holds."""
        return self._kv().count(self.prefix)

    def clone(self) -> Any:
        """The same store over new connections (it does not own the fallback server)."""
        return type(self)(self.address, self._secret, self.prefix, self.timeout, self._hello, encrypt=self._encrypt)

    def close(self) -> None:
        """Close every connection, and the fallback server this store owns. Safe to call twice."""
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()
        self._local = threading.local()
        if self._server is not None:
            self._server.stop()
            self._server = None


def open_store(name: str, rank: int, size: int, timeout: timedelta, *, job: JobEnv | None, secret: bytes | None,
               exchange: Callable[[bytes], Sequence[bytes]], job_id: str = "",
               kv_address: str | None = None) -> Any:
    """The rendezvous store of a torch.distributed group ``name`` (see the module docstring). Collective.

    ``exchange``: every rank's bytes in rank order (only rank 0's are read), over the job's own authenticated
    rendezvous or backend: rank 0 publishes the generation (and, in the fallback, its service's address) so that
    every rank uses the same keys even when ranks have opened different numbers of groups before.
    ``kv_address``: the launcher's KV service the ranks met through, if the caller knows it.
    """
    if size == 1:
        import torch.distributed as dist

        store = dist.HashStore()
        store.set_timeout(timeout)
        return store
    attempt = job.attempt if job is not None else 0
    encrypt = job is not None and job.encrypt
    job_id = job_id or (job.job_id if job is not None else "")
    secret = secret if secret is not None else (job.secret if job is not None else None)
    address, hello = kv_address or (job.rendezvous if job is not None else None), None
    if not address and job is not None and job.service_address:
        address, hello = job.service_address, ("hello", job.job_id, job.rank, "kv")  # the global rank
    fallback = not address or secret is None
    server, mine = None, b""
    base = f"{job_id}/torch/{attempt}/{name}"
    if rank == 0:
        fresh = b""
        if fallback:  # a service of our own, under the job's secret (or a fresh one where the job has none)
            fresh = make_secret() if secret is None else b""
            server = KVStoreServer(secret or fresh, host=listen_address(meeting_host(None, job))[0], encrypt=encrypt)
            host, port = server.start()
            address, hello = f"{host}:{port}", None
        client = KVClient(address, secret or fresh, timeout.total_seconds(), hello=hello, encrypt=encrypt)
        try:
            generation = client.incr(f"{base}/generation")
        finally:
            client.close()
        mine = f"{generation}|{address if fallback else ''}|{fresh.hex()}".encode()
    generation_s, published, fresh_hex = bytes(exchange(mine)[0]).decode().split("|")
    if fallback:
        address, hello = published, None
        secret = secret if secret is not None else bytes.fromhex(fresh_hex)
    return kv_store_class()(address, secret, f"{base}/{generation_s}/", timeout, hello, server, encrypt=encrypt)
