"""torchrun's launch contract inside a spark_hvd rank: its variables, and ``env://`` over the job's own store.

Code written for ``torchrun`` learns everything from the environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` ...) and meets its peers through
``dist.init_process_group()``, whose default ``env://`` rendezvous builds an unauthenticated ``TCPStore`` on
``MASTER_ADDR:MASTER_PORT``. spark_hvd's launchers (``run()`` on Spark, ``spark-hvd-run``) give every rank:

- ``torchrun_env(job, master_addr, master_port)``: the variables torch 2.13's elastic agent sets for a worker
  (``torch/distributed/elastic/agent/server/local_elastic_agent.py``), from the rank's ``JobEnv``, so they agree
  with ``hvd.rank()`` / ``hvd.local_rank()`` / ``hvd.cross_rank()``: a host is a torchrun "node" (``GROUP_RANK`` =
  cross rank). ``TORCHELASTIC_RUN_ID`` is the job id and ``TORCHELASTIC_RESTART_COUNT`` the run's attempt.
  ``TORCHELASTIC_USE_AGENT_STORE`` is never set (it would make rank 0 a TCPStore client of an agent there is not).
- ``install()``: ``env://`` answered by spark_hvd. The handler gives ``init_process_group`` a ``KVTorchStore``
  (``spark_hvd.core.backends.torch_store``) on the job's authenticated KV service (the launcher's, or the Spark driver
  service): no port is opened for the rendezvous, and a connection without the job's secret is refused before
  any key is read. Outside a spark_hvd job, or with ``SPARK_HVD_TORCH_STORE=tcp``, it hands the call to torch's own
  handler, which builds the plain ``TCPStore`` on ``MASTER_ADDR:MASTER_PORT`` (the launchers still pick a free
  port there, so code that opens a ``TCPStore`` itself, or an explicit ``init_method="tcp://..."``, works too,
  unauthenticated, as under torchrun). torch is not imported here: where ``torch.distributed.rendezvous`` is not
  loaded yet, an import hook installs the handler the moment it is.

The keys of the n-th ``env://`` group of a job live under ``<job id>/torch/<attempt>/env/<n>/`` (n counted per
process: the ranks of a job call ``init_process_group`` in the same order, as torch itself requires).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.abc
import importlib.machinery
import logging
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

from spark_hvd.core.jobenv import JobEnv

logger = logging.getLogger(__name__)

#: ``job`` (default): ``env://`` meets over the job's authenticated KV store; ``tcp``: torch's own TCPStore.
STORE_ENV = "SPARK_HVD_TORCH_STORE"
#: Every variable ``torchrun_env`` sets (launchers clear them from a parent job's environment).
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")
_MODULE = "torch.distributed.rendezvous"

_lock = threading.Lock()
_generations: dict[tuple[str, int], int] = {}
#: The stores handed to torch. A Python ``Store`` whose Python object is collected fails every call from C++
#: ("Not implemented"), and torch keeps only its C++ side: they are kept here until ``destroy_default_group``.
_stores: list[Any] = []
_original: Any = None
#: every torch.distributed process group made in this Python worker, kept until it exits (``_keep_groups``)
_kept: list[Any] = []
#: The CUDA_VISIBLE_DEVICES spark_hvd last set in this process (``pin_visible_devices``).
_cuda_visible: list[str] | None = None


def torchrun_env(job: JobEnv, master_addr: str, master_port: int, max_restarts: int = 0) -> dict[str, str]:
    """torchrun's worker variables for the rank ``job`` describes (see the module docstring)."""
    return {
        "RANK": str(job.rank), "WORLD_SIZE": str(job.size),
        "LOCAL_RANK": str(job.local_rank), "LOCAL_WORLD_SIZE": str(job.local_size),
        "GROUP_RANK": str(job.cross_rank), "GROUP_WORLD_SIZE": str(job.cross_size),
        "ROLE_RANK": str(job.rank), "ROLE_WORLD_SIZE": str(job.size), "ROLE_NAME": "default",
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": job.job_id or "none", "TORCHELASTIC_RESTART_COUNT": str(job.attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
    }


def visible_devices(local_gpus: Sequence[str | None]) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for the ranks of one host, given the GPU address Spark assigned to each of them in
    local-rank order: the addresses joined in that order, so that ``cuda:LOCAL_RANK`` is the rank's own GPU (what
    torchrun-style code uses); None unless every local rank was assigned one."""
    if not local_gpus or any(g is None for g in local_gpus):
        return None
    return ",".join(str(g) for g in local_gpus)


def pin_visible_devices(job: JobEnv, local_gpus: Sequence[str | None]) -> tuple[JobEnv, dict[str, str]]:
    """The rank's ``JobEnv`` and extra variables so that ``cuda:LOCAL_RANK`` is the GPU Spark assigned to it.

    ``local_gpus``: the addresses Spark assigned to the ranks of this host, in local-rank order. Where every one
    has a GPU and CUDA is not initialised in this process yet, ``CUDA_VISIBLE_DEVICES`` becomes those addresses
    (as TorchDistributor does) and ``job.gpu`` the rank's index among them (its local rank). Where CUDA already
    runs in this (reused) Python worker, its devices cannot change: ``job.gpu`` becomes the address's index among
    the devices spark_hvd made visible before, if it set them, and nothing is exported (``LOCAL_RANK`` may then not
    index the rank's GPU: use ``SPARK_HVD_GPU``).
    """
    global _cuda_visible
    visible = visible_devices(local_gpus)
    if visible is None or job.gpu is None:
        return job, {}
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        _cuda_visible = visible.split(",")
        return dataclasses.replace(job, gpu=str(job.local_rank)), {"CUDA_VISIBLE_DEVICES": visible}
    logger.warning("rank %d: CUDA was initialised in this Python worker before the job, so CUDA_VISIBLE_DEVICES "
                   "cannot be set to the GPUs Spark assigned; LOCAL_RANK may not index this rank's GPU "
                   "(SPARK_HVD_GPU does)", job.rank)
    if _cuda_visible is not None and job.gpu in _cuda_visible:
        return dataclasses.replace(job, gpu=str(_cuda_visible.index(job.gpu))), {}
    return job, {}


def job_store(job: JobEnv, timeout: timedelta) -> Any:
    """A ``KVTorchStore`` for the next ``env://`` group of ``job``, on the job's authenticated KV service."""
    from spark_hvd.core.backends.torch_store import kv_store_class

    if job.rendezvous:
        address, hello = job.rendezvous, None
    else:
        address, hello = job.service_address, ("hello", job.job_id, job.rank, "kv")
    with _lock:
        key = (job.job_id, job.attempt)
        _generations[key] = generation = _generations.get(key, 0) + 1
    prefix = f"{job.job_id}/torch/{job.attempt}/env/{generation}/"
    store = kv_store_class()(address, job.secret, prefix, timeout, hello, encrypt=job.encrypt)
    with _lock:  # torch holds the C++ half only: the Python store must outlive the group (see _stores)
        _stores.append(store)
    return store


def _job_for_env() -> JobEnv | None:
    """The job whose store ``env://`` uses, or None (no job, no secret or service, or ``SPARK_HVD_TORCH_STORE=tcp``)."""
    setting = os.environ.get(STORE_ENV, "job").strip().lower()
    if setting not in ("job", "tcp"):
        raise ValueError(f"{STORE_ENV}={setting!r}: expected 'job' or 'tcp'")
    if setting == "tcp":
        return None
    job = JobEnv.from_env()
    if job is None or job.secret is None or not (job.rendezvous or job.service_address):
        return None
    return job


def env_rendezvous(url: str, timeout: timedelta | None = None, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    """The ``env://`` handler: ``(store, rank, world_size)`` on the job's store, else torch's own handler's."""
    job = _job_for_env()
    if job is None:
        yield from _original(url, **({"timeout": timeout} if timeout is not None else {}), **kwargs)
        return
    from torch.distributed.constants import default_pg_timeout

    _keep_groups()  # torch.distributed is loaded whole by now: the group this rendezvous is for is kept too

    query = dict(p.split("=", 1) for p in urlparse(url).query.split("&") if "=" in p)
    rank = int(query.get("rank") or os.environ.get("RANK") or job.rank)
    world_size = int(query.get("world_size") or os.environ.get("WORLD_SIZE") or job.size)
    yield job_store(job, timeout or default_pg_timeout), rank, world_size
    raise RuntimeError("Unable to perform re-rendezvous using env:// method")


def _keep_groups() -> None:
    """Keep every process group torch.distributed makes in this process alive until the process ends.

    A ``ProcessGroupGloo`` whose last reference Python's garbage collector drops (the DDP module of a job that has
    ended, say) runs its C++ destructor holding the GIL, and the destructor joins the group's work threads, which
    need the GIL to exit (they drop Python objects of their thread-local state): the process deadlocks. torchrun's
    processes exit instead; Spark reuses Python workers, and a 2-rank FSDP script hung in workers that had run a
    DDP script before (the DDP module collected in the next job). A kept group costs its idle threads and sockets
    until the worker exits."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    helper = getattr(c10d, "_new_process_group_helper", None)
    if helper is None or getattr(helper, "spark_hvd_keeps", False):
        return
    world = getattr(c10d, "_world", None)
    _kept.extend(getattr(world, "pg_map", None) or ())  # groups made before this (a user-built TCPStore, say)

    @functools.wraps(helper)
    def keeping(*args: Any, **kwargs: Any) -> Any:
        made = helper(*args, **kwargs)
        _kept.append(made[0] if isinstance(made, tuple) else made)
        return made

    keeping.spark_hvd_keeps = True  # type: ignore[attr-defined]
    c10d._new_process_group_helper = keeping  # type: ignore[union-attr]


def _patch(module: Any) -> None:
    global _original
    handlers = module._rendezvous_handlers
    if handlers.get("env") is env_rendezvous:
        return
    _original = handlers["env"]
    handlers["env"] = env_rendezvous


class _Hook(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Patches ``torch.distributed.rendezvous`` right after it is first imported."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        self._inner = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        _patch(module)


_hook = _Hook()


def install() -> None:
    """Answer ``env://`` with ``env_rendezvous`` in this process (now, or when torch.distributed is imported)."""
    module = sys.modules.get(_MODULE)
    if module is not None:
        _patch(module)
    elif _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)


def master_address(towards: str | None) -> tuple[str, int]:
    """Rank 0's ``(MASTER_ADDR, MASTER_PORT)``: the address a ring rank would publish (``SPARK_HVD_IFACE_ADDR``,
    the interface named by ``SPARK_HVD_NETWORK_INTERFACE``, else the one routed towards ``towards``, the driver
    service or the rendezvous, ``host:port``: ``spark_hvd.core.transport.addresses``), and a port free there now (only
    code that opens its own TCPStore binds it)."""
    import socket

    from spark_hvd.core.transport.addresses import listen_address
    from spark_hvd.core.transport.rendezvous import parse_address

    host = listen_address(parse_address(towards)[0] if towards else None)[1]
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return host, int(sock.getsockname()[1])


def destroy_default_group() -> None:
    """At the end of a rank: destroy torch.distributed's default group if the user's code left one (Spark reuses
    Python workers, and the next job's ``init_process_group`` would find it), and close the ``env://`` stores."""
    dist = sys.modules.get("torch.distributed")
    _keep_groups()
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # best effort: the rank's own result or error matters more
        logger.warning("could not destroy the torch.distributed default group the job left", exc_info=True)
    with _lock:
        stores, _stores[:] = list(_stores), []
    for store in stores:
        store.close()
