"""The barrier task's side of ``run``: each task of the stage is one rank of the job.

Rank = partition id; the ranks exchange their host names and the GPU address Spark assigned to each task through
the key-value table of the attempt's driver service (``KVRendezvous`` over a connection whose hello says ``"kv"``:
authenticated with the job's secret, encrypted under ``encrypt``) to get local rank, local size, cross rank and
cross size and to check that no two ranks of a host share a GPU; the task writes its ``JobEnv`` (``SPARK_HVD_*``)
into the environment, initialises ``spark_hvd.core`` over the same rendezvous (a user's own ``hvd.init()`` is then
a no-op), forwards its stdout/stderr to the driver and runs ``fn``. Not Spark's ``BarrierTaskContext.allGather``:
a rank that arrives first there is answered at Spark's next one-second poll of the barrier, about 1 s an exchange,
two at every start (``benchmarks/fit_profile.py``).
Everything is undone afterwards, since Spark reuses Python workers. The result goes back as the task's one row
(``RESULT_SCHEMA``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cloudpickle

from spark_hvd.core import torchrun
from spark_hvd.core.jobenv import JobEnv, check_distinct_gpus, topology
from spark_hvd.core.transport.addresses import host_identity
from spark_hvd.core.transport.rendezvous import KVRendezvous
from spark_hvd.runner import client as _client
from spark_hvd.runner.client import OutputForwarder, ServiceClient
from spark_hvd.runner.errors import RunnerError
from spark_hvd.runner.start_lines import quiet_imports

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskSetup:
    """What every task of one attempt's barrier stage gets (pickled into its function)."""


    service_address: str
    secret: bytes
    job_id: str
    attempt: int
    num_proc: int
    env: dict[str, str]
    use_gpu: bool | None
    payload: bytes
    tee: bool
    encrypt: bool = False
    #: seconds a rank waits in the rendezvous for the others (the driver's start timeout cancels the stage first)
    start_timeout: float = 600.0


def assigned_gpu(ctx: Any) -> str | None:
    """The first GPU address Spark assigned to this task (``resources()["gpu"]``), or None."""
    try:
        resources = ctx.resources()
    except Exception:  # older contexts / no resource support
        resources = {}
    gpu = resources.get("gpu")
    addresses = list(gpu.addresses) if gpu is not None else []
    return str(addresses[0]).strip() if addresses else None


def task_gpus(hosts: Sequence[str], assigned: Sequence[str | None], use_gpu: bool | None) -> list[str | None]:
    """Every rank's GPU by the runner's policy: the address Spark assigned; with ``use_gpu=True`` and none
    assigned, the local rank; with ``use_gpu=False``, none. Two ranks of one host on one GPU raise ``RunnerError``
    naming them (never wrapped around)."""
    gpus: list[str | None] = []
    for rank, gpu in enumerate(assigned):
        if use_gpu is False:
            gpu = None
        elif gpu is None and use_gpu:
            gpu = str(topology(hosts, rank)[0])
        gpus.append(gpu)
    try:
        check_distinct_gpus(hosts, gpus)
    except ValueError as exc:
        raise RunnerError(str(exc)) from None
    return gpus


#: The rows of the barrier stage: one per rank, its result cloudpickled.
RESULT_SCHEMA = "rank long, result binary"


def make_mapper(setup: TaskSetup) -> Callable:
    """The barrier ``mapInArrow`` function: runs the rank, yields its one result row."""

    def mapper(batches: Any) -> Any:
        import pyarrow as pa
        from pyspark import BarrierTaskContext

        for _ in batches:  # the input is the rank's own id only: drain it
            pass
        rank, payload = run_rank(BarrierTaskContext.get(), setup)
        yield pa.RecordBatch.from_arrays([pa.array([rank], pa.int64()), pa.array([payload], pa.binary())],
                                         names=["rank", "result"])

    return mapper


def run_rank(ctx: Any, setup: TaskSetup) -> tuple[int, bytes]:
    """Run this task's rank (see the module docstring); its rank and its result cloudpickled."""
    rank = ctx.partitionId()
    size = setup.num_proc
    if ctx.attemptNumber() > 0:
        raise RunnerError(f"rank {rank}: Spark retried this barrier task (attempt {ctx.attemptNumber()}); spark_hvd "
                          f"does not resume a rank alone: the run fails, use run(max_retries=...) to run it again")
    client = ServiceClient(setup.service_address, setup.secret, setup.job_id, rank, attempt=setup.attempt,
                           encrypt=setup.encrypt)
    forwarder = OutputForwarder(client, tee=setup.tee)
    saved_env: dict[str, str | None] = {}
    error: BaseException | None = None
    result: Any = None
    core = None
    try:
        forwarder.start()
        rendezvous = KVRendezvous(setup.service_address, setup.secret, setup.job_id, setup.start_timeout + 30.0,
                                  encrypt=setup.encrypt, hello=("hello", setup.job_id, rank, "kv"))
        master = torchrun.master_address(setup.service_address) if rank == 0 else None
        mine = json.dumps([host_identity(), assigned_gpu(ctx), master]).encode()
        hosts, assigned, masters = zip(*(json.loads(v) for v in rendezvous.exchange(rank, size, mine)),
                                       strict=True)
        local_rank, local_size, cross_rank, cross_size = topology(hosts, rank)
        gpus = task_gpus(hosts, assigned, setup.use_gpu)
        job = JobEnv(rank=rank, size=size, local_rank=local_rank, local_size=local_size, cross_rank=cross_rank,
                     cross_size=cross_size, job_id=setup.job_id, secret=setup.secret,
                     service_address=setup.service_address, attempt=setup.attempt, gpu=gpus[rank],
                     encrypt=setup.encrypt)
        # torchrun's variables, and Spark's GPUs of this host visible in local-rank order (cuda:LOCAL_RANK)
        spark_gpus = [gpus[r] if assigned[r] is not None else None for r in range(size) if hosts[r] == hosts[rank]]
        job, cuda_env = torchrun.pin_visible_devices(job, spark_gpus)
        env = job.to_env()
        env.update(cuda_env)
        env.update(torchrun.torchrun_env(job, *masters[0]))
        env.update(setup.env)
        for key, value in env.items():
            saved_env[key] = os.environ.get(key)
            os.environ[key] = value
        _client.set_client(client)
        with quiet_imports():  # the payload imports the frameworks its objects need (start_lines.py)
            fn, args, kwargs = cloudpickle.loads(setup.payload)
        import spark_hvd.core as core

        core.init(rendezvous=rendezvous, rank=rank, size=size, secret=setup.secret, job_id=setup.job_id)
        torchrun.install()  # dist.init_process_group() meets over the job's store
        result = fn(*args, **kwargs)
        payload = cloudpickle.dumps(result)
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the driver, then to Spark
        error = exc
        # tell the driver before shutting the core down: the peers' errors that the shutdown causes must
        # arrive after this rank's own, so the driver names the cause and not a consequence
        forwarder.stop()
        client.send_error(error)
    finally:
        if core is not None:
            try:
                core.shutdown()
            except Exception:
                logger.exception("rank %d: spark_hvd.core.shutdown() failed", rank)
        torchrun.destroy_default_group()
        _client.set_client(None)
        forwarder.stop()
        for key, old in saved_env.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
        if error is None:
            client.send_done()
        client.close()
    if error is not None:
        raise error
    return rank, payload
