"""``TorchDeviceGroup``: the engine's ``DeviceGroup`` for tensors reduced where they lie
(``spark_hvd.core.engine.device``).

NCCL for CUDA tensors; gloo stands in on CPU (``SPARK_HVD_DEVICE_BACKEND=gloo``), running exactly this code.
torch is imported when a group is opened, not with this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import numpy as np

from spark_hvd.core.backend import Backend, ReduceOp, rank_rows
from spark_hvd.core.engine.device import DeviceBuffer, DeviceGroup, GroupScope
from spark_hvd.core.errors import PeerFailureError, SparkHvdError
from spark_hvd.core.jobenv import gpu_index, running_job
from spark_hvd.core.settings import Settings
from spark_hvd.core.transport.addresses import apply_device_group_env

_ZERO_OPS = frozenset({"sum", "average"})


class TorchDeviceGroup(DeviceGroup):
    """The engine's collectives on tensors where they lie: NCCL for CUDA tensors, gloo standing in on CPU.

    Set up collectively (see ``spark_hvd.core.engine.device``): the ranks meet through a ``KVTorchStore``
    (``spark_hvd.core.backends.torch_store``) on the job's own authenticated KV service (the launcher's, or the Spark
    driver service), so spark_hvd opens no port for the rendezvous and every store connection proves the job's
    secret. (NCCL's own bootstrap and data sockets, and gloo's, carry no authentication: that part of the device
    path is as trusted as the cluster network, as NCCL always is.) The whole job's group is ``torch.distributed``'s
    default group when the process has none, else a new group over the same ranks (meeting through the default
    group's store). A process set's group (``scope.process_set``) is an independent gloo / NCCL group of its
    members only, on the set's own namespace of the store, registered nowhere in ``torch.distributed``: setting it
    up involves no other rank (see ``spark_hvd.core.engine.device``). Each engine thread alone drives its group, so a
    group's collectives are issued in one order on all its ranks.

    CUDA: the engine waits on each tensor's ``ready`` event (recorded on the producer's stream) before the
    collective, and for the collective to complete before the handle finishes; nothing is copied to the host.
    float16 and bfloat16 are reduced in float32, as on the ring.
    """

    def __init__(self, device: str, kind: str, backend: Backend, settings: Settings, scope: GroupScope) -> None:
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        self.device, self.kind, self.scope = device, kind, scope
        self._widen = {getattr(torch, n) for n in ("int16", "uint16", "uint32") if hasattr(torch, n)}
        self.rank, self.size = backend.rank, backend.size
        self.where = scope.label(self.rank)
        timeout = timedelta(seconds=settings.timeout_s)
        apply_device_group_env()  # NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME from SPARK_HVD_NETWORK_INTERFACE
        if device == "cuda":  # the rank's GPU by the one policy (the engine thread has its own current device)
            self._dev = torch.device("cuda", gpu_index(scope.job or running_job(backend, None),
                                                       torch.cuda.device_count(), required=True))
            if kind == "nccl":  # gloo has no such rule: ranks sharing a GPU reduce on it through host memory
                _one_gpu_per_rank(backend, scope, self._dev.index)
        else:
            self._dev = torch.device("cpu")
        self._store: Any = None
        self._owns = False  # this group is torch.distributed's default group (destroyed with it)
        if scope.process_set:  # the set's members only, on their own namespace of the KV store
            self._store = store = _open_store(device, backend, timeout, scope)
            self._pg: Any = _independent_group(dist, kind, store, self.rank, self.size, timeout, self._dev, scope)
        elif not dist.is_initialized():
            self._owns = True
            self._store = store = _open_store(device, backend, timeout, scope)
            extra = {"device_id": self._dev} if kind == "nccl" else {}
            dist.init_process_group(kind, store=store, rank=self.rank, world_size=self.size, timeout=timeout,
                                    **extra)
            self._pg = dist.group.WORLD
        else:
            if (dist.get_rank(), dist.get_world_size()) != (self.rank, self.size):
                raise PeerFailureError(
                    f"torch.distributed is already initialised as rank {dist.get_rank()} of {dist.get_world_size()} "
                    f"in a spark_hvd job where this process is rank {self.rank} of {self.size}", operation="setup")
            # a new group meets through the default group's store (with SPARK_HVD_BACKEND=torch: ours too)
            self._pg = dist.new_group(backend=kind, timeout=timeout)
        self.closed = False

    # -- helpers -----------------------------------------------------------------------------------------------
    def _enter(self, bufs: Sequence[DeviceBuffer]) -> None:
        if self.device != "cuda":
            return
        stream, waited = None, None
        for buf in bufs:
            if buf.tensor.get_device() != self._dev.index:
                raise ValueError(f"a tensor on {buf.tensor.device} reached {self.where}, whose GPU is {self._dev} "
                                 "(SPARK_HVD_GPU, else the local rank); a rank's tensors must be on its own GPU")
            if buf.ready is not None and buf.ready is not waited:  # a grouped call's tensors share one event
                stream = stream or self._torch.cuda.current_stream(self._dev)
                stream.wait_event(buf.ready)
                waited = buf.ready

    def _done(self) -> None:
        if self.device == "cuda":
            self._torch.cuda.current_stream(self._dev).synchronize()

    def _call(self, what: str, method: str, *args: Any) -> None:
        """``self._pg.<method>(*args)`` and its completion: the ``ProcessGroup`` call ``torch.distributed``'s own
        functions make, on the default group, a new group or a set's independent one alike."""
        try:
            with self._torch.cuda.device(self._dev) if self.device == "cuda" else _nothing():
                work = getattr(self._pg, method)(*args)
                if work is not None:
                    work.wait()  # CUDA: the current stream waits for the collective (``_done`` waits for it)
        except RuntimeError as exc:  # NCCL / gloo report dead peers and timeouts as RuntimeError
            raise PeerFailureError(f"torch.distributed {what} ({self.kind}) failed on {self.where}: {exc}",
                                   operation=what) from exc

    def _opts(self, kind: str, **fields: Any) -> Any:
        """``torch.distributed``'s ``<kind>Options`` with ``fields``, synchronous as its functions make them."""
        opts = getattr(self._dist.distributed_c10d, f"{kind}Options")()
        opts.asyncOp = False
        for name, value in fields.items():
            setattr(opts, name, value)
        return opts

    def _scale(self, t: Any, factor: float) -> None:
        if factor == 1.0:
            return
        if t.is_floating_point():
            t.mul_(factor)
        else:  # integers truncate toward zero, as on the ring
            t.copy_(self._torch.trunc(t.double() * factor))

    def _bytes(self, t: Any) -> Any:
        return t.reshape(-1).view(self._torch.uint8)

    # -- collectives -------------------------------------------------------------------------------------------
    def allreduce(self, bufs: Sequence[DeviceBuffer], op: ReduceOp, prescale: float, postscale: float,
                  bfloat16: bool = False) -> None:
        torch = self._torch
        self._enter(bufs)
        tensors = [b.tensor for b in bufs]
        flat = tensors[0].reshape(-1) if len(tensors) == 1 else torch.cat([t.reshape(-1) for t in tensors])
        if flat.dtype in (torch.float16, torch.bfloat16):
            work = flat.float()
        elif flat.dtype in self._widen:  # integer types NCCL cannot reduce (exact in int64)
            work = flat.long()
        else:
            work = flat
        self._scale(work, prescale)
        if work.numel():
            self._call("allreduce", "allreduce", [work], self._opts("Allreduce", reduceOp=_TORCH_OPS[op](self._dist)))
        if op is ReduceOp.AVERAGE and self.size > 1:
            if work.is_floating_point():
                work.div_(self.size)
            else:
                work.copy_(torch.div(work, self.size, rounding_mode="trunc"))
        self._scale(work, postscale)
        if work is not flat:
            flat.copy_(work)
        if len(tensors) > 1:  # back into the tensors: one multi-tensor copy, not a copy launched per tensor
            torch._foreach_copy_([t.view(-1) for t in tensors], flat.split([b.size for b in bufs]))
        self._done()

    def _gather_counts(self, count: int) -> list[int]:
        torch = self._torch
        mine = torch.tensor([count], dtype=torch.int64, device=self._dev)
        every = [torch.zeros(1, dtype=torch.int64, device=self._dev) for _ in range(self.size)]
        self._call("allgather", "allgather", [every], [mine], self._opts("Allgather"))
        return [int(c.item()) for c in every]

    def allgather(self, buf: DeviceBuffer) -> Any:
        torch = self._torch
        self._enter([buf])
        t = buf.tensor
        rows = self._gather_counts(t.shape[0])
        row_bytes = int(np.prod(t.shape[1:], dtype=np.int64)) * t.element_size()
        most = max(rows) * row_bytes
        padded = torch.zeros(most, dtype=torch.uint8, device=self._dev)
        mine = self._bytes(t)
        padded[:mine.numel()] = mine
        outs = [torch.empty(most, dtype=torch.uint8, device=self._dev) for _ in range(self.size)]
        if most:
            self._call("allgather", "allgather", [outs], [padded], self._opts("Allgather"))
        data = torch.cat([o[:r * row_bytes] for o, r in zip(outs, rows, strict=True)])
        self._done()
        return data.view(t.dtype).reshape(sum(rows), *t.shape[1:])

    def broadcast(self, buf: DeviceBuffer, root: int) -> None:
        self._enter([buf])
        if buf.nbytes:
            # root: the group's own rank (for a set, the caller translated the global root_rank)
            self._call("broadcast", "broadcast", [self._bytes(buf.tensor)],
                       self._opts("Broadcast", rootRank=root, rootTensor=0))
        self._done()

    def alltoall(self, buf: DeviceBuffer, splits: Sequence[int]) -> tuple[Any, list[int]]:
        torch = self._torch
        self._enter([buf])
        t = buf.tensor
        mine = torch.tensor(list(splits), dtype=torch.int64, device=self._dev)
        every = [torch.zeros(self.size, dtype=torch.int64, device=self._dev) for _ in range(self.size)]
        self._call("alltoall", "allgather", [every], [mine], self._opts("Allgather"))
        recv = [int(e[self.rank].item()) for e in every]
        row_bytes = int(np.prod(t.shape[1:], dtype=np.int64)) * t.element_size()
        out = torch.empty(sum(recv) * row_bytes, dtype=torch.uint8, device=self._dev)
        if row_bytes and (sum(splits) or sum(recv)):
            self._call("alltoall", "alltoall_base", out, self._bytes(t), [r * row_bytes for r in recv],
                       [s * row_bytes for s in splits], self._opts("AllToAll"))
        self._done()
        return out.view(t.dtype).reshape(sum(recv), *t.shape[1:]), recv

    def reducescatter(self, buf: DeviceBuffer, op: ReduceOp, prescale: float, postscale: float,
                      bfloat16: bool = False) -> Any:
        work = buf.tensor.clone()
        if work.dim() == 0:
            work = work.reshape(1)
        self.allreduce([DeviceBuffer(work, buf.device, buf.dtype, tuple(work.shape), buf.bfloat16, buf.ready)],
                       op, prescale, postscale)
        return work[rank_rows(work.shape[0], self.size, self.rank)].clone()

    def placeholder(self, shape: tuple[int, ...], dtype: np.dtype, bfloat16: bool, op: str) -> DeviceBuffer:
        torch = self._torch
        tdtype = torch.bfloat16 if bfloat16 else torch.from_numpy(np.empty(0, dtype)).dtype
        if op in _ZERO_OPS:
            t = torch.zeros(shape, dtype=tdtype, device=self._dev)
        elif op == "product":
            t = torch.ones(shape, dtype=tdtype, device=self._dev)
        elif bfloat16 or np.dtype(dtype).kind == "f":
            t = torch.full(shape, float("inf") if op == "min" else float("-inf"), dtype=tdtype, device=self._dev)
        else:
            info = np.iinfo(dtype)
            t = torch.full(shape, int(info.max if op == "min" else info.min), dtype=tdtype, device=self._dev)
        return DeviceBuffer(t, self.device, dtype, shape, bfloat16)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        dist, pg, self._pg = self._dist, self._pg, None
        if self.scope.process_set:  # an independent group: nothing of torch.distributed's global state
            shutdown = getattr(pg, "shutdown", None)
            if shutdown is not None:
                shutdown()
        elif dist.is_initialized():
            dist.destroy_process_group() if self._owns else dist.destroy_process_group(pg)
        close = getattr(self._store, "close", None)  # a KVTorchStore's connections (a HashStore has none)
        if close is not None:
            close()


_TORCH_OPS = {ReduceOp.SUM: lambda d: d.ReduceOp.SUM, ReduceOp.AVERAGE: lambda d: d.ReduceOp.SUM,
              ReduceOp.MIN: lambda d: d.ReduceOp.MIN, ReduceOp.MAX: lambda d: d.ReduceOp.MAX,
              ReduceOp.PRODUCT: lambda d: d.ReduceOp.PRODUCT}


class _nothing:  # noqa: N801 - a null context manager, cheaper than contextlib's on the hot path
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _one_gpu_per_rank(backend: Backend, scope: GroupScope, index: int) -> None:
    """``SparkHvdError`` on every rank of the group, naming the ranks, when two of them would use one GPU of one
    host (NCCL refuses a communicator with two ranks on one device, or hangs). Collective over the group."""
    rows = backend.allgather(np.array([backend.cross_rank, index], dtype=np.int64)).reshape(-1, 2).tolist()
    shared = shared_gpus(rows, scope.ranks)
    if shared:
        where = "; ".join(f"ranks {ranks} on GPU {gpu} of one host" for gpu, ranks in shared)
        raise SparkHvdError(f"{where}{' in process set ' + str(scope.process_set) if scope.process_set else ''}: "
                            "NCCL needs a GPU of its own for each rank of a communicator (check SPARK_HVD_GPU and "
                            "Spark's spark.task.resource.gpu.amount, or set SPARK_HVD_DEVICE_BACKEND=none to reduce "
                            "CUDA tensors through host memory)")


def shared_gpus(rows: Sequence[Sequence[int]], ranks: Sequence[int]) -> list[tuple[int, list[int]]]:
    """``(gpu, global ranks)`` for every GPU more than one rank of a group would use, given each group rank's
    ``(host index, gpu)`` in ``rows`` and the group's global ``ranks``."""
    users: dict[tuple[int, int], list[int]] = {}
    for r, (host, gpu) in enumerate(rows):
        users.setdefault((int(host), int(gpu)), []).append(ranks[r])
    return [(gpu, found) for (_, gpu), found in users.items() if len(found) > 1]


def _independent_group(dist: Any, kind: str, store: Any, rank: int, size: int, timeout: timedelta, dev: Any,
                       scope: GroupScope) -> Any:
    """A gloo / NCCL group of ``size`` ranks on ``store`` alone, as ``torch.distributed`` builds each backend of a
    group (``_new_process_group_helper``) but registered nowhere: only its members take part in setting it up."""
    if kind == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    from torch.distributed import ProcessGroupNCCL

    opts = ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    opts._timeout = timeout
    for name, value in (("group_name", f"spark_hvd.ps{scope.process_set}"),
                        ("global_ranks_in_group", list(scope.ranks))):  # what NCCL's logs and flight recorder show
        if hasattr(opts, name):
            setattr(opts, name, value)
    pg = ProcessGroupNCCL(store, rank, size, opts)
    connect = getattr(pg, "eager_connect_single_device", None)
    if connect is not None:  # the communicator now, in the setup round, as init_process_group(device_id=) does
        connect(dev)
    return pg


def _open_store(device: str, backend: Backend, timeout: timedelta, scope: GroupScope) -> Any:
    """The group's rendezvous store on the job's KV service (collective; ``spark_hvd.core.backends.torch_store``)."""
    from spark_hvd.core.backends.torch_store import open_store

    def exchange(mine: bytes) -> list[bytes]:  # only rank 0 publishes: the gathered rows are its bytes
        return [backend.allgather(np.frombuffer(mine, dtype=np.uint8)).tobytes()]

    # keys under <job id>/torch/<attempt>/device-<kind>/<generation>/: a set's backend has the job id <job>.ps<id>
    return open_store(f"device-{device}", backend.rank, backend.size, timeout, job=scope.job, secret=None,
                      job_id=getattr(backend, "job_id", ""), exchange=exchange)
