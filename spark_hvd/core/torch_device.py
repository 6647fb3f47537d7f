"""``TorchDeviceGroup``: the engine's ``DeviceGroup`` for tensors reduced where they lie (``spark_hvd.core.device``).

NCCL for CUDA tensors; gloo stands in on CPU (``SPARK_HVD_DEVICE_BACKEND=gloo``), running exactly this code.
torch is imported when a group is opened, not with this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import numpy as np

from spark_hvd.core.backend import Backend, ReduceOp, rank_rows
from spark_hvd.core.device import DeviceBuffer, DeviceGroup
from spark_hvd.core.errors import PeerFailureError
from spark_hvd.core.jobenv import JobEnv, gpu_index, running_job
from spark_hvd.core.settings import Settings

_ZERO_OPS = frozenset({"sum", "average"})


class TorchDeviceGroup(DeviceGroup):
    """The engine's collectives on tensors where they lie: NCCL for CUDA tensors, gloo standing in on CPU.

    Set up collectively (see ``spark_hvd.core.device``): the ranks meet through a ``KVTorchStore``
    (``spark_hvd.core.torch_store``) on the job's own authenticated KV service (the launcher's, or the Spark
    driver service), so spark_hvd opens no port for the rendezvous and every store connection proves the job's
    secret. (NCCL's own bootstrap and data sockets, and gloo's, carry no authentication: that part of the device
    path is as trusted as the cluster network, as NCCL always is.) The group is ``torch.distributed``'s default
    group when the process has none, else a new group over the same ranks (meeting through the default group's
    store). The engine thread alone drives it, so collectives are issued in one order on every rank.

    CUDA: the engine waits on each tensor's ``ready`` event (recorded on the producer's stream) before the
    collective, and for the collective to complete before the handle finishes; nothing is copied to the host.
    float16 and bfloat16 are reduced in float32, as on the ring.
    """

    def __init__(self, device: str, kind: str, backend: Backend, settings: Settings) -> None:
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        self.device, self.kind = device, kind
        self._widen = {getattr(torch, n) for n in ("int16", "uint16", "uint32") if hasattr(torch, n)}
        self.rank, self.size = backend.rank, backend.size
        timeout = timedelta(seconds=settings.timeout_s)
        if device == "cuda":  # the rank's GPU by the one policy (the engine thread has its own current device)
            self._dev = torch.device("cuda", gpu_index(running_job(backend), torch.cuda.device_count(),
                                                       required=True))
        else:
            self._dev = torch.device("cpu")
        self._store: Any = None
        self._owns = not dist.is_initialized()
        if self._owns:
            self._store = store = _open_store(device, backend, timeout)
            extra = {"device_id": self._dev} if kind == "nccl" else {}
            dist.init_process_group(kind, store=store, rank=self.rank, world_size=self.size, timeout=timeout,
                                    **extra)
            self._group = dist.group.WORLD
        else:
            if (dist.get_rank(), dist.get_world_size()) != (self.rank, self.size):
                raise PeerFailureError(
                    f"torch.distributed is already initialised as rank {dist.get_rank()} of {dist.get_world_size()} "
                    f"in a spark_hvd job where this process is rank {self.rank} of {self.size}", operation="setup")
            # a new group meets through the default group's store (with SPARK_HVD_BACKEND=torch: ours too)
            self._group = dist.new_group(backend=kind, timeout=timeout)
        self._closed = False

    # -- helpers -----------------------------------------------------------------------------------------------
    def _enter(self, bufs: Sequence[DeviceBuffer]) -> None:
        if self.device != "cuda":
            return
        stream, waited = None, None
        for buf in bufs:
            if buf.tensor.get_device() != self._dev.index:
                raise ValueError(f"a tensor on {buf.tensor.device} reached rank {self.rank}, whose GPU is {self._dev} "
                                 "(SPARK_HVD_GPU, else the local rank); a rank's tensors must be on its own GPU")
            if buf.ready is not None and buf.ready is not waited:  # a grouped call's tensors share one event
                stream = stream or self._torch.cuda.current_stream(self._dev)
                stream.wait_event(buf.ready)
                waited = buf.ready

    def _done(self) -> None:
        if self.device == "cuda":
            self._torch.cuda.current_stream(self._dev).synchronize()

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            with self._torch.cuda.device(self._dev) if self.device == "cuda" else _nothing():
                return fn(*args, group=self._group, **kwargs)
        except RuntimeError as exc:  # NCCL / gloo report dead peers and timeouts as RuntimeError
            raise PeerFailureError(f"torch.distributed {what} ({self.kind}) failed on rank {self.rank}: {exc}",
                                   operation=what) from exc

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
    def allreduce(self, bufs: Sequence[DeviceBuffer], op: ReduceOp, prescale: float, postscale: float) -> None:
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
            self._call("allreduce", self._dist.all_reduce, work, op=_TORCH_OPS[op](self._dist))
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
        self._call("allgather", self._dist.all_gather, every, mine)
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
            self._call("allgather", self._dist.all_gather, outs, padded)
        data = torch.cat([o[:r * row_bytes] for o, r in zip(outs, rows, strict=True)])
        self._done()
        return data.view(t.dtype).reshape(sum(rows), *t.shape[1:])

    def broadcast(self, buf: DeviceBuffer, root: int) -> None:
        self._enter([buf])
        if buf.nbytes:
            self._call("broadcast", self._dist.broadcast, self._bytes(buf.tensor), src=root)
        self._done()

    def alltoall(self, buf: DeviceBuffer, splits: Sequence[int]) -> tuple[Any, list[int]]:
        torch = self._torch
        self._enter([buf])
        t = buf.tensor
        mine = torch.tensor(list(splits), dtype=torch.int64, device=self._dev)
        every = [torch.zeros(self.size, dtype=torch.int64, device=self._dev) for _ in range(self.size)]
        self._call("alltoall", self._dist.all_gather, every, mine)
        recv = [int(e[self.rank].item()) for e in every]
        row_bytes = int(np.prod(t.shape[1:], dtype=np.int64)) * t.element_size()
        out = torch.empty(sum(recv) * row_bytes, dtype=torch.uint8, device=self._dev)
        if row_bytes and (sum(splits) or sum(recv)):
            self._call("alltoall", self._dist.all_to_all_single, out, self._bytes(t),
                       output_split_sizes=[r * row_bytes for r in recv],
                       input_split_sizes=[s * row_bytes for s in splits])
        self._done()
        return out.view(t.dtype).reshape(sum(recv), *t.shape[1:]), recv

    def reducescatter(self, buf: DeviceBuffer, op: ReduceOp, prescale: float, postscale: float) -> Any:
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
        if self._closed:
            return
        self._closed = True
        dist = self._dist
        if dist.is_initialized():
            dist.destroy_process_group() if self._owns else dist.destroy_process_group(self._group)
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


def _open_store(device: str, backend: Backend, timeout: timedelta) -> Any:
    """The group's rendezvous store on the job's KV service (collective; ``spark_hvd.core.torch_store``)."""
    from spark_hvd.core.torch_store import open_store

    def exchange(mine: bytes) -> list[bytes]:  # only rank 0 publishes: the gathered rows are its bytes
        return [backend.allgather(np.frombuffer(mine, dtype=np.uint8)).tobytes()]

    return open_store(f"device-{device}", backend.rank, backend.size, timeout, job=JobEnv.from_env(), secret=None,
                      job_id=getattr(backend, "job_id", ""), exchange=exchange)
