"""The Ray actor behind each rank of a ``RayExecutor`` job (``ray.remote(RayWorker)``, one per worker).

Its life: ``describe()`` (where Ray placed it: node id and address, GPUs, pid, a free port for torchrun's
``MASTER_PORT``), ``setup(...)`` (claim the job's secret from the driver, ``spark_hvd.ray.secret``; write the
rank's ``JobEnv`` and torchrun's variables into the environment; connect to the driver service, the runner's,
for ``report(...)`` and elastic commits; join the job's ring through the driver's KV rendezvous; build the user's
``executable_cls``), then any number of ``run`` / ``execute`` calls, then
``cleanup()`` (stop every process the rank started, leave the ring, drop torch.distributed's default group)
before the driver kills the actor.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

from spark_hvd.core import torchrun
from spark_hvd.core.jobenv import JobEnv, env_names
from spark_hvd.core.transport.addresses import HOST_ID_ENV, machine_identity
from spark_hvd.ray.secret import Claim, fetch_secret
from spark_hvd.runner import rank_tree

logger = logging.getLogger(__name__)


def _ray_node() -> tuple[str, str]:
    """``(node id, node address)`` of the Ray node this process runs on."""
    import ray

    # in a worker, the address the node's raylet was started with: the one Ray itself reaches this node at
    return ray.get_runtime_context().get_node_id(), str(ray.util.get_node_ip_address())


def job_marker(job_id: str) -> str:
    """The ``SPARK_HVD_RANK_MARK`` every process a rank of job ``job_id`` starts carries (``sweep``)."""
    return f"ray:{job_id}"


def sweep(marker: str, within_s: float = rank_tree.KILL_WITHIN_S) -> list[int]:
    """On one node (a Ray task placed there): SIGKILL every process of this host whose environment carries
    ``SPARK_HVD_RANK_MARK=marker`` until none is left or ``within_s`` passed; the pids killed. The actors themselves
    do not carry it (it is set in their ``os.environ`` after they started, which ``/proc/PID/environ`` does not
    show), so this reaches what the ranks started even when an actor was killed before its ``cleanup``."""
    import signal
    import time

    killed: set[int] = set()
    deadline = time.monotonic() + within_s
    while True:
        found = rank_tree.job_processes(rank_tree.MARK_ENV, marker)
        if not found or time.monotonic() > deadline:
            return sorted(killed)
        killed.update(found)
        rank_tree.signal_all(found, signal.SIGKILL)
        time.sleep(0.02)


class RayWorker:
    """One rank's actor (see the module docstring). Its constructor arguments are stored in Ray's GCS: they hold
    a one-time ``Claim``, never the job's secret."""

    def __init__(self, claim: Claim, index: int) -> None:
        self._claim = claim
        self.index = index
        self.executable: Any = None
        self.job: JobEnv | None = None
        self._marker = job_marker(claim.job_id)
        self._client: Any = None

    def describe(self) -> dict[str, Any]:
        """Where this worker runs: ``node_id``, ``node_ip``, ``hostname``, ``pid``, ``gpu_ids`` (Ray's
        assignment) and ``free_port`` (a port free on the node address now, torchrun's ``MASTER_PORT`` if this
        worker becomes rank 0)."""
        import ray

        node_id, node_ip = _ray_node()
        with socket.socket(socket.AF_INET6 if ":" in node_ip else socket.AF_INET) as sock:
            sock.bind((node_ip, 0))
            port = int(sock.getsockname()[1])
        return {"node_id": node_id, "node_ip": node_ip, "hostname": socket.gethostname(), "pid": os.getpid(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "free_port": port}

    def setup(self, job: JobEnv, env: Mapping[str, str], timeout_s: float, executable_cls: type | None = None,
              executable_args: list[Any] | None = None,
              executable_kwargs: dict[str, Any] | None = None) -> None:
        """Become rank ``job.rank`` (``job`` without its secret): see the module docstring.

        ``env``: torchrun's variables, the GPUs, the user's ``extra_env_vars`` ... (set after the launch contract,
        so a user's value wins). ``SPARK_HVD_HOST_ID`` is set to this machine's identity and the Ray node, so that
        the ring's host (which decides shared memory) is the Ray node, as the rank's local ranks are.
        """
        from spark_hvd.core.transport.rendezvous import KVRendezvous

        secret = fetch_secret(self._claim, timeout_s)
        job = dataclasses.replace(job, secret=secret)
        for name in set(env_names()) | set(torchrun.TORCHRUN_VARS):  # nothing of another job this process saw
            os.environ.pop(name, None)
        node_id, _ = _ray_node()
        os.environ[HOST_ID_ENV] = f"{machine_identity()}/ray-node:{node_id}"
        os.environ[rank_tree.MARK_ENV] = self._marker  # every process the rank starts carries it (cleanup)
        os.environ.update(job.to_env())
        os.environ.update({k: str(v) for k, v in env.items()})
        self.job = job
        if job.service_address:  # report(...) and the elastic driver's requests (spark_hvd.runner.client)
            from spark_hvd.runner import client as service_client

            self._client = service_client.ServiceClient(job.service_address, secret, job.job_id, job.rank,
                                                        attempt=job.attempt, timeout_s=timeout_s,
                                                        encrypt=job.encrypt)
            service_client.set_client(self._client)
        import spark_hvd.core as core

        assert job.rendezvous is not None
        core.init(rendezvous=KVRendezvous(job.rendezvous, secret, job.job_id, timeout_s, encrypt=job.encrypt),
                  rank=job.rank, size=job.size, secret=secret, job_id=job.job_id)
        torchrun.install()  # dist.init_process_group() meets over the job's authenticated store
        if executable_cls is not None:
            self.executable = executable_cls(*(executable_args or []), **(executable_kwargs or {}))

    def execute(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` (the ``executable_cls`` instance, or None)."""
        return fn(self.executable)

    def run(self, fn: Callable[..., Any], args: list[Any] | tuple[Any, ...] | None = None,
            kwargs: dict[str, Any] | None = None) -> Any:
        """``fn(*args, **kwargs)``."""
        return fn(*(args or ()), **(kwargs or {}))

    def env(self, names: list[str]) -> dict[str, str | None]:
        """The values of ``names`` in this worker's environment (for checks)."""
        return {name: os.environ.get(name) for name in names}

    def cleanup(self) -> dict[int, str]:
        """Before the actor is killed: SIGKILL every process the rank started (its descendants, and those that
        carry the job's marker after leaving the tree: those of the node's other ranks too), leave the ring (which
        unmaps its shared memory) and destroy torch.distributed's default group. Returns pid -> name of the
        processes killed."""
        killed, alive = rank_tree.kill_until_gone(os.getpid(), self._marker, keep=-1)
        if alive:
            logger.warning("RayExecutor worker %d: processes %s survived SIGKILL", self.index, alive)
        import spark_hvd.core as core

        try:
            core.shutdown()
        except Exception:  # best effort: the actor is killed next anyway
            logger.warning("RayExecutor worker %d: spark_hvd.core.shutdown() failed", self.index, exc_info=True)
        torchrun.destroy_default_group()
        if self._client is not None:
            from spark_hvd.runner import client as service_client

            service_client.set_client(None)
            self._client.close()
            self._client = None
        return killed
