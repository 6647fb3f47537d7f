"""``RayExecutor``: Horovod's executor for Ray, over spark_hvd's launch contract and ring.

The driver process plays the launcher's part (``spark-hvd-run``, ``spark_hvd.runner.launch``): it makes the job's
secret and id, runs the job's authenticated KV rendezvous (``spark_hvd.core.transport.rendezvous.KVStoreServer``, the
launcher's service) on its Ray node's address, and gives each worker its ``JobEnv`` and torchrun's variables
(``spark_hvd.core.torchrun``). What differs is the seam: workers are Ray actors (``spark_hvd.ray.worker``) placed
by a placement group (``PACK`` for ``num_workers``; ``STRICT_SPREAD``, one bundle per host, for ``num_hosts`` x
``num_workers_per_host``; the current placement group where there is one and ``use_current_placement_group``).

**Ranks.** A Ray node is a host: ranks are numbered node by node (``spark_hvd.ray.placement``), local and cross
ranks come from ``spark_hvd.core.jobenv.topology``, and each actor's ``SPARK_HVD_HOST_ID`` is its machine and Ray
node, so the ring's shared memory follows the same hosts. A rank publishes the address Ray reaches its node at
(``SPARK_HVD_IFACE_ADDR``), unless the user names an interface (``create_settings(nics=...)``,
``SPARK_HVD_NETWORK_INTERFACE``) or an address. With ``use_gpu``, every worker of a node sees the GPUs Ray gave
that node's workers, in local-rank order (``CUDA_VISIBLE_DEVICES``), so ``cuda:LOCAL_RANK`` is its own.

**The secret** never goes through Ray (an actor's arguments and ``runtime_env`` are stored in Ray's GCS, and
objects in its object store): each actor gets a one-time claim, and fetches the secret from the driver over an
authenticated connection, sealed with an ephemeral X25519 key exchange (``spark_hvd.ray.secret``, which says what
that protects against and what not). Setting it through ``runtime_env={"env_vars": ...}`` was rejected: it would
sit in the GCS in the clear.

**Failures.** ``run``/``execute`` wait for every rank; the first failure raises ``RayWorkerFailedError`` naming
the rank, its Ray node (address and id) and, for an exception, its remote traceback; a rank whose actor died is
preferred as the cause over ranks that failed because a peer went away. ``shutdown()`` stops every process the
ranks started (the idle ranks themselves; then a task on each of the job's nodes kills whatever carries the
job's marker, ``spark_hvd.ray.worker.sweep``, so a rank killed mid-function leaves nothing either), leaves the
ring, kills the actors, waits until Ray reports them dead, removes the placement group
it made and stops the driver's services.

**Elastic** (``min_workers``/``max_workers``): ``start()`` places nothing; ``run(fn)`` runs attempts of as many
workers as Ray can place, through lost workers and growth, with Spark's elastic code (``spark_hvd.ray.elastic``).

The ring is joined in ``start()``, so a user's own ``hvd.init()`` in a function is harmless (Horovod's examples
call it), and ``hvd.shutdown()`` then ``hvd.init()`` joins again.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from spark_hvd.core.jobenv import ENCRYPT, JobEnv, encrypt_requested, topology
from spark_hvd.core.transport.addresses import IFACE_ENV, NETWORK_INTERFACE_ENV
from spark_hvd.core.transport.wire import make_secret
from spark_hvd.ray import checkpoints, placement
from spark_hvd.ray.errors import PlacementTimeoutError, RayExecutorError, RayWorkerFailedError, WorkerNode
from spark_hvd.ray.reports import RankZeroReports, then_mark
from spark_hvd.ray.secret import SecretHandout
from spark_hvd.runner.errors import CONSEQUENCE_TYPES, RankFailure

logger = logging.getLogger(__name__)

#: Seconds ``run`` keeps collecting other ranks' failures after the first, to name the cause rather than a
#: consequence (a peer that failed because the dead rank's sockets closed).
FAILURE_SETTLE_S = 2.0
#: Seconds between two deliveries of rank 0's reports to a run's callbacks (a checkpoint of rank 0 waits for one).
POLL_S = 0.05
#: Seconds a run with callbacks waits, after the ranks finished, for rank 0's last reports.
LAST_REPORT_WAIT_S = 10.0
#: Seconds ``shutdown`` gives an idle worker to clean up before it is killed.
CLEANUP_WAIT_S = 3.0
#: Seconds ``shutdown`` gives the sweeps of the nodes, then the workers to be reported dead after ``ray.kill``.
SHUTDOWN_WAIT_S = 15.0


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ImportError("spark_hvd.ray needs Ray: pip install 'spark_hvd[ray]'") from exc
    return ray


@dataclass(frozen=True)
class RaySettings:
    """What ``RayExecutor.create_settings`` makes (Horovod's ``MiniSettings``).

    ``timeout_s``: seconds for the workers to start, fetch the secret and meet at the rendezvous;
    ``placement_group_timeout_s``: seconds for Ray to place the workers; ``nics``: network interfaces the ranks
    use (``SPARK_HVD_NETWORK_INTERFACE``); ``encrypt``: encrypt every frame between the ranks and with the driver's
    services (None: ``SPARK_HVD_ENCRYPT`` of ``start``'s ``extra_env_vars`` or of the driver's environment);
    ``verbose``: kept for Horovod's signature.
    """

    timeout_s: float = 30.0
    placement_group_timeout_s: float = 100.0
    nics: frozenset[str] | None = None
    encrypt: bool | None = None
    verbose: int = 1
    elastic: bool = field(default=False)


@dataclass(frozen=True)
class ElasticParams:
    """An elastic job's bounds (``RayExecutor(min_workers=..., ...)``, ``spark_hvd.ray.elastic``)."""

    min_workers: int
    max_workers: int
    reset_limit: int | None
    cooldown_s: float
    elastic_timeout: float

    @classmethod
    def make(cls, min_workers: int, max_workers: int | None, reset_limit: int | None,
             cooldown_range: Sequence[float] | None, elastic_timeout: float | None) -> ElasticParams:
        """Checked bounds: ``max_workers`` None is unbounded (Horovod's default); ``cooldown_range``'s lower end
        is the pause after a reset; ``elastic_timeout`` None is ``HOROVOD_ELASTIC_TIMEOUT``, else 600 s."""
        from spark_hvd.ray.elastic import COOLDOWN_S
        from spark_hvd.runner.elastic import elastic_timeout_s

        high = (1 << 30) if max_workers is None else max_workers
        if not isinstance(min_workers, int) or min_workers < 1 or high < min_workers:
            raise ValueError(f"need 1 <= min_workers <= max_workers, got min_workers={min_workers}, "
                             f"max_workers={max_workers}")
        if reset_limit is not None and reset_limit < 0:
            raise ValueError(f"reset_limit must be >= 0 or None, got {reset_limit}")
        cooldown = float(cooldown_range[0]) if cooldown_range else COOLDOWN_S
        return cls(min_workers, high, reset_limit, cooldown, elastic_timeout_s(elastic_timeout))


class RayExecutor:
    """Run a spark_hvd job on Ray actors, with Horovod's ``horovod.ray.RayExecutor`` API.

    Args:
        settings: ``RayExecutor.create_settings(...)``.
        num_workers: ranks of the job (placed with ``PACK``); or
        num_hosts, num_workers_per_host: that many hosts with that many ranks each (``STRICT_SPREAD``).
        cpus_per_worker: Ray CPUs each worker reserves.
        use_gpu: reserve GPUs for the workers (``gpus_per_worker`` each, 1 by default).
        gpus_per_worker: GPUs per worker with ``use_gpu``.
        use_current_placement_group: place the workers in the placement group this code runs in, if any.
        min_workers, max_workers: an elastic job (``spark_hvd.ray.elastic``) of that many workers, as many as Ray
            can place; ``run(fn)`` then resumes ``fn`` from its last ``state.commit()`` after a lost worker, and
            grows it at a commit when Ray could place more.
        reset_limit: the most relaunches of an elastic job (None: no limit).
        cooldown_range: its lower end is the pause, in seconds, after a reset before free workers are counted.
        elastic_timeout: seconds to wait for ``min_workers`` to fit (default ``HOROVOD_ELASTIC_TIMEOUT``, else 600).
        override_discovery: Horovod's; accepted and ignored (Ray's free resources are the discovery).

    Example::

        executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=2)
        executor.start()
        results = executor.run(train, kwargs={"epochs": 2})   # train() may use spark_hvd.torch as hvd
        executor.shutdown()
    """

    @classmethod
    def create_settings(cls, timeout_s: float = 30, ssh_identity_file: str | None = None,
                        ssh_str: str | None = None, placement_group_timeout_s: float = 100,
                        nics: set[str] | None = None, encrypt: bool | None = None) -> RaySettings:
        """Horovod's settings for Ray: ``timeout_s`` (start and rendezvous), ``placement_group_timeout_s``,
        ``nics``; and spark_hvd's ``encrypt`` (``RaySettings``). ``ssh_identity_file`` / ``ssh_str`` are accepted
        for Horovod's signature and ignored: actors start through Ray, not ssh (no private key is written
        anywhere)."""
        if ssh_identity_file or ssh_str:
            logger.info("RayExecutor.create_settings: ssh_identity_file/ssh_str are not used (workers start "
                        "through Ray)")
        return RaySettings(timeout_s=float(timeout_s), placement_group_timeout_s=float(placement_group_timeout_s),
                           nics=frozenset(nics) if nics else None, encrypt=encrypt)

    def __init__(self, settings: RaySettings | None = None, num_workers: int | None = None,
                 num_hosts: int | None = None, num_workers_per_host: int | None = 1, cpus_per_worker: float = 1,
                 use_gpu: bool = False, gpus_per_worker: float | None = None,
                 use_current_placement_group: bool = True, min_workers: int | None = None,
                 max_workers: int | None = None, reset_limit: int | None = None,
                 cooldown_range: list[int] | None = None, elastic_timeout: float | None = None,
                 override_discovery: bool = True) -> None:
        if max_workers is not None and not min_workers:
            raise ValueError("max_workers given without a positive min_workers: an elastic job needs min_workers")
        if min_workers is not None and (num_workers is not None or num_hosts is not None):
            raise ValueError("give num_workers (a fixed job) or min_workers (an elastic one), not both")
        if num_workers is not None and num_hosts is not None:
            raise ValueError("give num_workers or num_hosts (with num_workers_per_host), not both")
        if num_workers is None and num_hosts is None and min_workers is None:
            raise ValueError("give num_workers, or num_hosts and num_workers_per_host, or min_workers")
        num_workers_per_host = 1 if num_workers_per_host is None else num_workers_per_host  # Horovod's tests pass None
        #: the elastic parameters, or None for a fixed job
        self.elastic: ElasticParams | None = None
        if min_workers is not None:
            self.elastic = ElasticParams.make(min_workers, max_workers, reset_limit, cooldown_range,
                                              elastic_timeout)
            num_workers = self.elastic.min_workers
        count = num_workers if num_workers is not None else num_hosts * num_workers_per_host  # type: ignore[operator]
        if count < 1 or num_workers_per_host < 1:
            raise ValueError(f"a job needs at least one worker (num_workers={num_workers}, num_hosts={num_hosts}, "
                             f"num_workers_per_host={num_workers_per_host})")
        self.settings = settings or RaySettings()
        self.num_workers = int(count)
        self.num_hosts = num_hosts
        self.num_workers_per_host = int(num_workers_per_host)
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = bool(use_gpu)
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.use_current_placement_group = use_current_placement_group
        self.workers: list[Any] = []  # actor handles in rank order
        self.nodes: list[WorkerNode] = []  # where each rank runs
        self.job_id: str | None = None
        #: the placement group the workers run in (None before start and after shutdown)
        self.placement_group: Any = None
        self._own_pg = False
        self._kv: Any = None
        self._service: Any = None
        self._job_nodes: set[str] = set()  # the Ray nodes of the current workers
        self._handout: SecretHandout | None = None
        self._start_args: tuple[Any, ...] = (None, None, None, {})
        #: called with every ``report(...)`` event of the ranks (``spark_hvd.runner.Event``), on a service thread
        self.on_event: Callable[[Any], None] | None = None
        self._reports = RankZeroReports()
        #: every frame between the ranks and with the driver's services is encrypted (decided in ``start``)
        self.encrypt = False

    # -- start -------------------------------------------------------------------------------------------------
    def start(self, executable_cls: type | None = None, executable_args: list[Any] | None = None,
              executable_kwargs: dict[str, Any] | None = None,
              extra_env_vars: dict[str, Any] | None = None) -> None:
        """Place the workers, give each its rank, join them in one ring, and build ``executable_cls(*args,
        **kwargs)`` in each (the object ``execute`` hands to its function). ``extra_env_vars`` are set in every
        worker before the ring is joined. Raises ``RayExecutorError`` (and stops what it started) when the
        workers cannot be placed within ``placement_group_timeout_s`` or do not start within ``timeout_s``."""
        if self.workers:
            raise RayExecutorError("this RayExecutor is already started; shutdown() first")
        self._start_args = (executable_cls, executable_args, executable_kwargs, dict(extra_env_vars or {}))
        self.encrypt = (encrypt_requested({**os.environ, **self._start_args[3]}) if self.settings.encrypt is None
                        else bool(self.settings.encrypt))
        if self.elastic is not None:  # each attempt of run() starts its own workers
            _ray()
            return
        self._start_workers(self.num_workers, 0)

    def _start_workers(self, size: int, attempt: int,
                       handlers: dict[str, Callable[[int, Any], Any]] | None = None) -> None:
        """Start ``size`` workers as attempt ``attempt`` of the job (``handlers``: requests the driver service
        answers, the elastic driver's); on failure, stop what was started and raise."""
        try:
            self._start(size, attempt, handlers, *self._start_args)
        except BaseException:
            self._stop_workers()
            raise

    def _driver_address(self, ray: Any) -> str:
        """The address of the driver's Ray node (the workers reach the driver's services there)."""
        node_id = ray.get_runtime_context().get_node_id()
        for node in ray.nodes():
            if node.get("NodeID") == node_id:
                return str(node["NodeManagerAddress"])
        raise RayExecutorError("RayExecutor: the driver is not on a node of the Ray cluster (a Ray Client "
                               "connection, ray://...?); run the driver on a node of the cluster")

    def _placement(self, ray: Any) -> list[dict[str, Any]]:
        """The workers' scheduling options (placement group and bundle), creating the group if needed."""
        from ray.util.placement_group import get_current_placement_group, placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        current = get_current_placement_group() if self.use_current_placement_group else None
        if current is not None:
            logger.info("RayExecutor: placing the workers in the current placement group "
                        "(use_current_placement_group=False to make a new one)")
            self.placement_group, self._own_pg, bundles = current, False, [-1] * self.num_workers
        else:
            gpu = {"GPU": self.gpus_per_worker} if self.use_gpu else {}
            if self.num_hosts is not None:
                per = self.num_workers_per_host
                specs = [{"CPU": self.cpus_per_worker * per, **({"GPU": gpu["GPU"] * per} if gpu else {})}
                         for _ in range(self.num_hosts)]
                strategy = "STRICT_SPREAD"
                bundles = [h for h in range(self.num_hosts) for _ in range(per)]
            else:
                specs = [{"CPU": self.cpus_per_worker, **gpu} for _ in range(self.num_workers)]
                strategy = "PACK"
                bundles = list(range(self.num_workers))
            self.placement_group, self._own_pg = placement_group(specs, strategy=strategy), True
            ready, _ = ray.wait([self.placement_group.ready()], timeout=self.settings.placement_group_timeout_s)
            if not ready:
                raise PlacementTimeoutError(
                    f"RayExecutor: Ray could not place {self.num_workers} workers ({strategy} bundles {specs}) "
                    f"within placement_group_timeout_s={self.settings.placement_group_timeout_s:g}; the cluster "
                    f"has {ray.available_resources()} available. Lower num_workers/cpus_per_worker or add nodes")
        return [{"scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_group, placement_group_bundle_index=b,
                    placement_group_capture_child_tasks=False)} for b in bundles]

    def _start(self, size: int, attempt: int, handlers: dict[str, Callable[[int, Any], Any]] | None,
               executable_cls: type | None, executable_args: list[Any] | None,
               executable_kwargs: dict[str, Any] | None, extra_env: dict[str, Any]) -> None:
        ray = _ray()
        from spark_hvd.core import torchrun
        from spark_hvd.core.transport.rendezvous import KVStoreServer
        from spark_hvd.ray.worker import RayWorker
        from spark_hvd.runner.service import DriverService

        if not ray.is_initialized():
            ray.init()
        timeout_s = self.settings.timeout_s
        secret = make_secret()
        self.job_id = job_id = secrets.token_hex(4)
        host = self._driver_address(ray)
        self._kv = KVStoreServer(secret, host=host, encrypt=self.encrypt)
        kv_host, kv_port = self._kv.start()
        # the runner's driver service: report(...) events, and the elastic driver's requests
        self._service = DriverService(secret, size, job_id=job_id, verbose=0, attempt=attempt, bind_host=host,
                                      handlers={checkpoints.REQUEST: self._reports.on_checkpoint, **(handlers or {})},
                                      on_event=self._on_event, encrypt=self.encrypt)
        service_port = self._service.start()[1]
        self._handout = SecretHandout(secret, job_id, host=host)
        del secret  # the driver's services hold it; nothing below may hand it to Ray

        self.num_workers = size
        options = self._placement(ray)
        remote = ray.remote(RayWorker)
        gpus = self.gpus_per_worker if self.use_gpu else 0
        actors = [remote.options(num_cpus=self.cpus_per_worker, num_gpus=gpus, max_restarts=0, **opts)
                  .remote(self._handout.claim(f"worker {i}"), i) for i, opts in enumerate(options)]
        self.workers = actors  # so that shutdown() reaches them should describe() fail
        described = self._get([a.describe.remote() for a in actors], timeout_s, "start")
        order = placement.rank_order([d["node_id"] for d in described])
        self.workers = [actors[i] for i in order]
        described = [described[i] for i in order]
        self.nodes = [WorkerNode(rank, d["node_ip"], d["node_id"], d["hostname"], d["pid"])
                      for rank, d in enumerate(described)]
        self._job_nodes = {d["node_id"] for d in described}
        node_ids = [d["node_id"] for d in described]
        assigned = placement.gpu_assignment(node_ids, [d["gpu_ids"] for d in described])
        master = (described[0]["node_ip"], described[0]["free_port"])
        calls = []
        for rank, (actor, d) in enumerate(zip(self.workers, described, strict=True)):
            local_rank, local_size, cross_rank, cross_size = topology(node_ids, rank)
            visible, gpu = assigned[rank]
            job = JobEnv(rank=rank, size=size, local_rank=local_rank, local_size=local_size,
                         cross_rank=cross_rank, cross_size=cross_size, job_id=job_id,
                         rendezvous=f"{kv_host}:{kv_port}", service_address=f"{host}:{service_port}",
                         attempt=attempt, gpu=gpu, encrypt=self.encrypt)
            env = torchrun.torchrun_env(job, *master)
            if self.settings.nics:
                env[NETWORK_INTERFACE_ENV] = ",".join(sorted(self.settings.nics))
            elif not {IFACE_ENV, NETWORK_INTERFACE_ENV} & set(extra_env):
                env[IFACE_ENV] = d["node_ip"]
            if visible is not None:
                env["CUDA_VISIBLE_DEVICES"] = visible
            env.update({k: str(v) for k, v in extra_env.items()})
            env[ENCRYPT] = "1" if self.encrypt else "0"  # what the services do, whatever extra_env_vars said
            calls.append(actor.setup.remote(job, env, timeout_s, executable_cls, executable_args,
                                             executable_kwargs))
        try:
            self._wait_all(calls, "start", timeout_s=timeout_s + 30.0)
        finally:
            if self._handout.reused:  # the cause, whatever the workers' failure says
                raise RayExecutorError(
                    f"RayExecutor: the secret claim of {', '.join(self._handout.reused)} was presented twice: "
                    "someone who can read Ray's GCS claimed it first; the job was stopped before it ran and its "
                    "secret is never used again")
        self._handout.close()  # every worker holds the secret: no claim is served any more
        self._handout = None

    def _get(self, refs: Sequence[Any], timeout_s: float, what: str) -> list[Any]:
        ray = _ray()
        ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        if pending:
            missing = [i for i, r in enumerate(refs) if r in pending]
            raise RayExecutorError(f"RayExecutor {what}: workers {missing} did not answer within {timeout_s:g} s "
                                   f"(Ray could not start their processes?)")
        return ray.get(list(refs))

    # -- running -----------------------------------------------------------------------------------------------
    def _check_started(self) -> None:
        if self.elastic is not None:
            raise NotImplementedError("RayExecutor: an elastic job runs its function with run(fn) only")
        if not self.workers:
            raise RayExecutorError("RayExecutor: start() the executor first")

    def _failure(self, rank: int, exc: BaseException) -> RankFailure:
        ray = _ray()
        node = self.nodes[rank] if rank < len(self.nodes) else None
        where = f" on Ray node {node.where()}" if node is not None else ""
        if isinstance(exc, ray.exceptions.RayTaskError):
            cause = getattr(exc, "cause", None)
            type_name = type(cause).__name__ if cause is not None else type(exc).__name__
            message = f"{cause}{where}" if cause is not None else f"{exc}{where}"
            return RankFailure(rank, "exception", type_name, message, traceback=str(exc), time=time.time(),
                               consequence=type_name in CONSEQUENCE_TYPES)
        if isinstance(exc, ray.exceptions.RayActorError):
            return RankFailure(rank, "lost", type(exc).__name__, f"its actor died{where}: {exc}", time=time.time())
        return RankFailure(rank, "exception", type(exc).__name__, f"{exc}{where}", time=time.time())

    def _wait_all(self, refs: list[Any], what: str, timeout_s: float | None = None,
                  poll: Callable[[], None] | None = None) -> list[Any]:
        """Every rank's result; the first failure raises ``RayWorkerFailedError`` (see the module docstring).
        ``timeout_s``: how long all may take (None: no limit; failures still surface at once); ``poll``: called
        every ``POLL_S`` while waiting, on this thread."""
        ray = _ray()
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        failures: list[RankFailure] = []
        settle_until: float | None = None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            now = time.monotonic()
            if settle_until is not None and now >= settle_until:
                break
            if deadline is not None and now >= deadline:
                missing = sorted(rank_of[r] for r in pending)
                raise RayExecutorError(f"RayExecutor {what}: ranks {missing} did not finish within {timeout_s:g} s "
                                       f"(on Ray nodes {[self.nodes[r].where() for r in missing]})")
            ready, pending = ray.wait(pending, num_returns=1, timeout=0.5 if poll is None else POLL_S)
            if poll is not None:
                poll()
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - a rank's failure: named below
                    failures.append(self._failure(rank_of[ref], exc))
                    if settle_until is None:
                        settle_until = time.monotonic() + FAILURE_SETTLE_S
        if failures:
            causes = [f for f in failures if f.kind == "lost"] or [f for f in failures if not f.consequence]
            cause = (causes or failures)[0]
            node = self.nodes[cause.rank] if cause.rank < len(self.nodes) else None
            raise RayWorkerFailedError(cause, [cause] + [f for f in failures if f is not cause], node=node,
                                       what=what)
        return ray.get(list(refs))

    def _on_event(self, event: Any) -> None:
        self._reports.on_event(event)
        if self.on_event is not None:
            self.on_event(event)

    def _with_callbacks(self, submit: Callable[[bool], list[Any]], what: str,
                        callbacks: list[Callable[..., Any]] | None) -> list[Any]:
        """Wait for the refs ``submit(marked)`` gives, handing rank 0's reports to ``callbacks`` meanwhile
        (``spark_hvd.ray.reports``); ``marked``: wrap the function with ``then_mark``."""
        if not callbacks:
            return self._wait_all(submit(False), what)
        self._reports.begin()
        try:
            results = self._wait_all(submit(True), what, poll=lambda: self._reports.deliver(callbacks))
            deadline = time.monotonic() + LAST_REPORT_WAIT_S
            while not self._reports.done and time.monotonic() < deadline:
                time.sleep(0.02)
                self._reports.deliver(callbacks)
            if not self._reports.done:
                logger.warning("RayExecutor.%s: rank 0's last reports did not arrive within %g s", what,
                               LAST_REPORT_WAIT_S)
            return results
        finally:
            self._reports.end()

    def run(self, fn: Callable[..., Any], args: list[Any] | None = None, kwargs: dict[str, Any] | None = None,
            callbacks: list[Callable[..., Any]] | None = None) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results by rank. ``callbacks``: Horovod's; each is called
        with every dict of metrics rank 0 reports (``spark_hvd.runner.report(**metrics)``), on this thread, while
        the ranks run (``spark_hvd.ray.reports``). In an elastic job (``min_workers``) ``fn`` uses
        ``hvd.elastic.run`` and a state: it runs until done, through resets (``spark_hvd.ray.elastic``), and the
        results are the last attempt's (``callbacks`` are not supported there yet)."""
        if self.elastic is not None:
            if callbacks:
                raise NotImplementedError("RayExecutor: callbacks of an elastic job are not supported yet")
            from spark_hvd.ray.elastic import run_elastic

            return run_elastic(self, fn, tuple(args or ()), dict(kwargs or {}))
        return self._with_callbacks(
            lambda marked: self.run_remote(then_mark, [fn, *(args or ())], kwargs) if marked
            else self.run_remote(fn, args, kwargs), "run", callbacks)

    def run_remote(self, fn: Callable[..., Any], args: list[Any] | None = None,
                   kwargs: dict[str, Any] | None = None) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank, without waiting: Ray object refs by rank (``ray.get`` them)."""
        self._check_started()
        return [w.run.remote(fn, args, kwargs) for w in self.workers]

    def execute(self, fn: Callable[[Any], Any], callbacks: list[Callable[..., Any]] | None = None) -> list[Any]:
        """``fn(executable)`` on every rank (the ``executable_cls`` object ``start`` built, or None); results by
        rank. ``callbacks``: as for ``run``."""
        self._check_started()
        return self._with_callbacks(
            lambda marked: [w.execute.remote(functools.partial(then_mark, fn) if marked else fn)
                            for w in self.workers], "execute", callbacks)

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0 only; its result."""
        self._check_started()
        return self._wait_all([self.workers[0].execute.remote(fn)], "execute_single")[0]

    # -- shutdown ----------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the job: every process the ranks started, the ring, the actors (waited for until Ray reports
        them dead), the placement group this executor made, the driver's services. Safe to call twice."""
        self._stop_workers()

    def _sweep(self, ray: Any, nodes: set[str]) -> None:
        """Kill what the ranks started on each of ``nodes`` (every live node when unknown): a task placed there
        (``spark_hvd.ray.worker.sweep``), for ranks whose actor was killed before it could clean up."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from spark_hvd.ray.worker import job_marker, sweep

        if self.job_id is None:
            return
        if not nodes:
            nodes = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        task = ray.remote(num_cpus=0, max_retries=0)(sweep)
        refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
                .remote(job_marker(self.job_id)) for node in sorted(nodes)]
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=SHUTDOWN_WAIT_S)
        for ref in ready:
            try:
                killed = ray.get(ref)
            except Exception:  # a node that went away meanwhile: nothing left to sweep there
                logger.debug("RayExecutor.shutdown: a sweep failed", exc_info=True)
                continue
            if killed:
                logger.info("RayExecutor.shutdown: killed processes %s the ranks left", killed)
        if pending:
            logger.warning("RayExecutor.shutdown: %d node(s) did not sweep the job's processes within %g s",
                           len(pending), SHUTDOWN_WAIT_S)

    def _stop_workers(self) -> None:
        """``shutdown`` of the current workers (an elastic job's attempt ends with it too)."""
        if self._service is not None:  # first: workers that go away now are not failures
            self._service.stop()
            self._service = None
        workers, self.workers = self.workers, []
        nodes, self._job_nodes = self._job_nodes, set()
        if workers:
            ray = _ray()
            # an idle worker cleans up (its processes, the ring); one still running a function is killed as it is
            cleaning = [w.cleanup.remote() for w in workers]
            cleaned, _ = ray.wait(cleaning, num_returns=len(cleaning), timeout=CLEANUP_WAIT_S)
            for w in workers:
                ray.kill(w, no_restart=True)
            if len(cleaned) < len(cleaning):  # (a cleanup kills what any rank of its node left)
                self._sweep(ray, nodes)
            deadline = time.monotonic() + SHUTDOWN_WAIT_S
            for rank, w in enumerate(workers):  # a killed actor's calls fail once Ray knows its process is gone
                while True:
                    try:
                        ray.get(w.__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
                    except ray.exceptions.RayActorError:
                        break
                    except ray.exceptions.GetTimeoutError:
                        pass
                    if time.monotonic() >= deadline:
                        logger.warning("RayExecutor.shutdown: rank %d's actor was not reported dead within %g s",
                                       rank, SHUTDOWN_WAIT_S)
                        break
                    time.sleep(0.05)
        if self.placement_group is not None and self._own_pg:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
        self.placement_group = None
        if self._handout is not None:
            self._handout.close()
            self._handout = None
        if self._kv is not None:
            self._kv.stop()
            self._kv = None
