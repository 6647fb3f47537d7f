"""The launch contract: what a rank is told about its job, in one frozen ``JobEnv``.

The Spark runner and ``spark-hvd-run`` write it into each rank's environment (``JobEnv.to_env()``); everything
else reads it (``JobEnv.from_env()``): ``core.init()``, the driver-service client, the bindings. The variable
names are public (a user script may read ``SPARK_HVD_RANK``), so they are listed once, here.

Three policies live beside it, so that every layer applies the same rule:

- ``topology(hosts, rank)``: local rank / size and cross rank / size from every rank's host name;
- ``gpu_index(job, device_count, ...)``: the CUDA ordinal of a rank. A GPU Spark assigned to the task
  (``JobEnv.gpu``, the address from ``BarrierTaskContext.resources()["gpu"]``) wins; otherwise the local rank.
  An index that is not a visible device is an error, never wrapped around onto another rank's GPU;
- ``torch_threads(job, cpus)``: intra-op threads per rank, the host's cores shared among its ranks.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

RANK = "SPARK_HVD_RANK"
SIZE = "SPARK_HVD_SIZE"
SECRET = "SPARK_HVD_SECRET"
GPU = "SPARK_HVD_GPU"
ENCRYPT = "SPARK_HVD_ENCRYPT"
_TRUE = {"1", "true", "yes", "on"}


def encrypt_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``SPARK_HVD_ENCRYPT`` asks for encryption in transit (1 / true / yes / on): what a driver or launcher
    that is given no ``encrypt=`` decides for its job, and writes into every rank's ``JobEnv``."""
    return (os.environ if environ is None else environ).get(ENCRYPT, "").strip().lower() in _TRUE


def _var(name: str) -> Any:
    return field(default=None, metadata={"env": name})


@dataclass(frozen=True)
class JobEnv:
    """One rank's view of its job, as the launcher set it up.

    ``secret`` is the job's key (bytes; hex in the environment, left out of ``repr``); ``rendezvous`` the
    ``host:port`` of the launcher's KV service (None under Spark, whose ranks meet in the driver service's KV table);
    ``service_address`` the driver service for output and ``report(...)``; ``attempt`` the run's attempt number
    (``run(max_retries=...)``); ``gpu`` the GPU address Spark assigned to the task, or None; ``encrypt``: every
    frame between the ranks and with the driver's services is encrypted (``SPARK_HVD_ENCRYPT``; the launcher
    decides it for the whole job, ``spark_hvd.core.transport.wire``).
    """

    rank: int = field(metadata={"env": RANK, "required": True})
    size: int = field(metadata={"env": SIZE, "required": True})
    local_rank: int = field(default=0, metadata={"env": "SPARK_HVD_LOCAL_RANK"})
    local_size: int = field(default=1, metadata={"env": "SPARK_HVD_LOCAL_SIZE"})
    cross_rank: int = field(default=0, metadata={"env": "SPARK_HVD_CROSS_RANK"})
    cross_size: int = field(default=1, metadata={"env": "SPARK_HVD_CROSS_SIZE"})
    job_id: str = field(default="", metadata={"env": "SPARK_HVD_JOB_ID"})
    secret: bytes | None = field(default=None, repr=False, metadata={"env": SECRET})
    rendezvous: str | None = _var("SPARK_HVD_RENDEZVOUS")
    service_address: str | None = _var("SPARK_HVD_DRIVER_SERVICE")
    attempt: int = field(default=0, metadata={"env": "SPARK_HVD_RUN_ATTEMPT"})
    gpu: str | None = _var(GPU)
    encrypt: bool = field(default=False, metadata={"env": ENCRYPT})

    def __post_init__(self) -> None:
        for name in ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size", "attempt"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"JobEnv.{name} must be an int, got {value!r}")
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"JobEnv: rank {self.rank} is not in a job of size {self.size}")
        if self.local_size < 1 or not 0 <= self.local_rank < self.local_size:
            raise ValueError(f"JobEnv: local rank {self.local_rank} is not among {self.local_size} local ranks")
        if self.cross_size < 1 or not 0 <= self.cross_rank < self.cross_size:
            raise ValueError(f"JobEnv: cross rank {self.cross_rank} is not among {self.cross_size} hosts")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> JobEnv | None:
        """The job this process was launched into, or None when no launcher set ``SPARK_HVD_RANK``/``_SIZE``.

        Raises ``ValueError`` naming the variable at fault: one of rank and size set without the other, an
        integer that is not one, a secret that is not hex.
        """
        env = os.environ if environ is None else environ
        if not env.get(RANK) and not env.get(SIZE):
            return None
        values: dict[str, Any] = {}
        for f in fields(cls):
            name = f.metadata["env"]
            raw = env.get(name)
            if raw in (None, ""):
                if f.metadata.get("required"):
                    raise ValueError(f"{name} is not set, but {RANK if name == SIZE else SIZE} is: a launched "
                                     "rank needs both (set by spark-hvd-run and the Spark runner)")
                continue
            if f.type == "int":
                try:
                    values[f.name] = int(raw)
                except ValueError:
                    raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
            elif f.name == "encrypt":
                values[f.name] = raw.strip().lower() in _TRUE
            elif f.name == "secret":
                try:
                    values[f.name] = bytes.fromhex(raw)
                except ValueError:
                    raise ValueError(f"environment variable {name} is not a hex string") from None
            else:
                values[f.name] = raw.strip()
        try:
            return cls(**values)
        except ValueError as exc:
            raise ValueError(f"the SPARK_HVD_* launch variables are inconsistent: {exc}") from None

    def to_env(self) -> dict[str, str]:
        """The environment variables that ``from_env`` reads back into an equal ``JobEnv`` (None fields left out)."""
        out: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, bool):
                out[f.metadata["env"]] = "1" if value else "0"
            else:
                out[f.metadata["env"]] = value.hex() if isinstance(value, bytes) else str(value)
        return out


def running_job(backend: Any, launched: JobEnv | None) -> JobEnv:
    """The launch contract as a job runs it: the launcher's ``JobEnv`` (``launched``, read once by ``init()``; None:
    none) with the topology ``backend`` found (the same under spark_hvd's launchers; the only source under
    ``mpirun`` or ``init(rank=, size=)``)."""
    topo = {name: getattr(backend, name) for name in
            ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size")}
    return dataclasses.replace(launched, **topo) if launched is not None else JobEnv(**topo)


def env_names() -> list[str]:
    """Every variable of the launch contract (for launchers that must set or clear them all)."""
    return [f.metadata["env"] for f in fields(JobEnv)]


def topology(hosts: Sequence[str], rank: int) -> tuple[int, int, int, int]:
    """``(local_rank, local_size, cross_rank, cross_size)`` of ``rank``, given every rank's host identity.

    Local ranks are numbered in rank order within a host; hosts in order of their first rank.
    """
    host = hosts[rank]
    same = [r for r, h in enumerate(hosts) if h == host]
    order = list(dict.fromkeys(hosts))
    return same.index(rank), len(same), order.index(host), len(order)


def gpu_index(job: JobEnv | None, device_count: int, *, required: bool = False) -> int | None:
    """The CUDA ordinal this rank uses, by the one GPU policy.

    ``job.gpu`` (the address Spark assigned to the task, or ``SPARK_HVD_GPU`` set by hand) wins; otherwise
    the local rank (0 outside a launched job). With no visible device, None. An index that is not a visible
    device raises ``ValueError`` when the GPU was assigned or ``required`` (never wrapped around onto a GPU
    another rank uses); an unassigned local rank beyond the devices gives None (the rank stays on the CPU).
    """
    rank = 0 if job is None else job.rank
    if job is not None and job.gpu is not None:
        try:
            index = int(job.gpu.split(",")[0])
        except ValueError:
            raise ValueError(f"rank {rank}: GPU address {job.gpu!r} ({GPU}) is not a CUDA ordinal") from None
        assigned = True
    else:
        index = 0 if job is None else job.local_rank
        assigned = required
    if 0 <= index < device_count:
        return index
    if not assigned:
        return None
    raise ValueError(f"rank {rank}: its GPU {index} is not among the {device_count} CUDA device(s) this process "
                     "sees; spark_hvd gives each rank its own GPU and does not share one between ranks (check "
                     "spark.task.resource.gpu.amount, the discovery script and CUDA_VISIBLE_DEVICES)")


def check_distinct_gpus(hosts: Sequence[str], gpus: Sequence[str | None]) -> None:
    """Raise ``ValueError`` naming the ranks when two ranks of one host were given the same GPU address."""
    seen: dict[tuple[str, str], int] = {}
    for rank, (host, gpu) in enumerate(zip(hosts, gpus, strict=True)):
        if gpu is None:
            continue
        other = seen.setdefault((host, gpu), rank)
        if other != rank:
            raise ValueError(f"ranks {other} and {rank} on host {host} were both given GPU {gpu}; each rank needs "
                             "a GPU of its own (set spark.task.resource.gpu.amount=1 and as many GPU addresses per "
                             "executor as it runs tasks)")


def torch_threads(job: JobEnv | None, cpus: int | None = None) -> int:
    """Intra-op threads for torch on this rank: the host's cores (``cpus``, default ``os.cpu_count()``) shared
    evenly among its ranks, at least one."""
    cpus = cpus if cpus is not None else (os.cpu_count() or 1)
    return max(1, cpus // (1 if job is None else job.local_size))
