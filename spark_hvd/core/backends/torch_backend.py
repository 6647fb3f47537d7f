"""The torch.distributed backend: gloo for CPU, NCCL when CUDA is chosen. torch is imported only here.

Chosen with ``SPARK_HVD_BACKEND=torch`` (or ``init(backend="torch")``). The ranks exchange host names through
the job's own rendezvous and meet, for torch.distributed, through a ``KVTorchStore`` on the job's authenticated KV
service (``spark_hvd.core.backends.torch_store``: no port of its own, every connection proves the job's secret). Only
when ``TorchBackend`` is built with no rendezvous at all does torch's own ``env://`` (``MASTER_ADDR`` /
``MASTER_PORT``, a TCPStore the user set up) apply.

Buffers stay numpy arrays: on CPU they are shared with torch tensors (no copy); with NCCL they are copied to this
rank's GPU (the one GPU policy, ``spark_hvd.core.jobenv.gpu_index``) and back. float16 and bfloat16 (uint16 view)
are reduced in float32; data that is only moved (broadcast, allgather, alltoall) travels as raw bytes. CUDA
tensors need none of this: they are reduced where they lie (``spark_hvd.core.engine.torch_device``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import numpy as np

from spark_hvd.core.backend import Backend, ReduceOp, Rendezvous, alltoall_args, as_rows, reducescatter_by_allreduce
from spark_hvd.core.errors import PeerFailureError
from spark_hvd.core.jobenv import JobEnv, gpu_index, topology
from spark_hvd.core.reduce import check_dtype, divide_average, reduce_widened
from spark_hvd.core.settings import Settings
from spark_hvd.core.transport.addresses import apply_device_group_env, host_identity
from spark_hvd.core.transport.rendezvous import KVRendezvous


class TorchBackend(Backend):
    """Collectives over a torch.distributed process group (gloo, or NCCL with ``device="cuda"``)."""

    name = "torch"

    def __init__(self, rank: int, size: int, rendezvous: Rendezvous | None, settings: Settings | None = None,
                 job_id: str = "", device: str | None = None, secret: bytes | None = None,
                 job: JobEnv | None = None) -> None:
        try:
            import torch
            import torch.distributed as dist
        except ImportError as exc:
            raise ImportError("the torch backend (SPARK_HVD_BACKEND=torch) needs PyTorch: "
                              "pip install 'spark_hvd[torch]'") from exc

        self._torch = torch
        self._dist = dist
        self.rank = rank
        self.size = size
        self.settings = settings or Settings.from_env()
        timeout = timedelta(seconds=self.settings.timeout_s)
        device = device or os.environ.get("SPARK_HVD_TORCH_DEVICE", "cpu")
        self.cuda = device.startswith("cuda")
        hostname = host_identity()
        apply_device_group_env()  # NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME from SPARK_HVD_NETWORK_INTERFACE
        self._store: Any = None
        if rendezvous is not None:
            from spark_hvd.core.backends.torch_store import open_store

            hosts = [v.decode() for v in rendezvous.exchange(rank, size, hostname.encode())]
            # a launcher's KV service; not a driver service's table (its connections need the job's hello)
            kv_address = (rendezvous.address if isinstance(rendezvous, KVRendezvous) and rendezvous.hello is None
                          else None)
            self._store = open_store("backend", rank, size, timeout, job=job, secret=secret,
                                     exchange=lambda mine: rendezvous.exchange(rank, size, mine), job_id=job_id,
                                     kv_address=kv_address)
            init: dict[str, Any] = {"store": self._store}
        else:
            hosts = [hostname] * size
            init = {"init_method": "env://"}
        if self.cuda:
            gpu = gpu_index(job, torch.cuda.device_count(), required=True)
            self.device = torch.device("cuda", gpu)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            dist.init_process_group("nccl" if self.cuda else "gloo", rank=rank, world_size=size, timeout=timeout,
                                    **init)
        self.local_rank, self.local_size, self.cross_rank, self.cross_size = topology(hosts, rank)
        self._ops = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.AVERAGE: dist.ReduceOp.SUM,
                     ReduceOp.MIN: dist.ReduceOp.MIN, ReduceOp.MAX: dist.ReduceOp.MAX,
                     ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT}
        self._closed = False

    def _tensor(self, arr: np.ndarray) -> Any:
        t = self._torch.from_numpy(arr)
        return t.to(self.device) if self.cuda else t

    def _back(self, t: Any, arr: np.ndarray) -> None:
        if self.cuda:
            arr[...] = t.cpu().numpy()

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RuntimeError as exc:  # gloo/NCCL report dead peers and timeouts as RuntimeError / DistBackendError
            raise PeerFailureError(f"torch.distributed {what} failed on rank {self.rank}: {exc}", rank=None,
                                   operation=what) from exc

    def allreduce(self, buf: np.ndarray, op: ReduceOp, *, bfloat16: bool = False) -> None:
        check_dtype(buf, bfloat16)
        if buf.size == 0:
            return
        if reduce_widened(buf, bfloat16, lambda wide: self.allreduce(wide, op)):
            return
        flat = buf.reshape(-1)
        t = self._tensor(flat)
        self._call("allreduce", self._dist.all_reduce, t, op=self._ops[op])
        self._back(t, flat)
        if op is ReduceOp.AVERAGE:
            divide_average(flat, self.size)

    def _bytes(self, arr: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)

    def allgather(self, buf: np.ndarray) -> np.ndarray:
        buf = as_rows(buf)
        rows = np.array([buf.shape[0]], dtype=np.int64)
        all_rows = np.zeros(self.size, dtype=np.int64)
        self._gather_bytes(self._bytes(rows), all_rows.view(np.uint8), 8)
        row_bytes = int(np.prod(buf.shape[1:], dtype=np.int64)) * buf.itemsize
        most = int(all_rows.max()) * row_bytes
        padded = np.zeros(most, dtype=np.uint8)
        mine = self._bytes(buf)
        padded[:mine.size] = mine
        gathered = np.empty(most * self.size, dtype=np.uint8)
        if most:
            self._gather_bytes(padded, gathered, most)
        parts = [gathered[r * most:r * most + int(all_rows[r]) * row_bytes] for r in range(self.size)]
        out = np.concatenate(parts) if parts else np.empty(0, np.uint8)
        return out.view(buf.dtype).reshape(int(all_rows.sum()), *buf.shape[1:])

    def _gather_bytes(self, mine: np.ndarray, out: np.ndarray, each: int) -> None:
        src = self._tensor(mine)
        outs = [self._tensor(out[r * each:(r + 1) * each]) for r in range(self.size)]
        self._call("allgather", self._dist.all_gather, outs, src)
        if self.cuda:
            for r, t in enumerate(outs):
                out[r * each:(r + 1) * each] = t.cpu().numpy()

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        if buf.nbytes == 0:
            return
        flat = buf.reshape(-1).view(np.uint8)
        t = self._tensor(flat)
        self._call("broadcast", self._dist.broadcast, t, src=root)
        self._back(t, flat)

    def alltoall(self, buf: np.ndarray, splits: Sequence[int] | None = None) -> tuple[np.ndarray, list[int]]:
        buf, splits = alltoall_args(buf, splits, self.size)
        send = np.asarray(splits, dtype=np.int64)
        recv = np.zeros(self.size, dtype=np.int64)
        # every rank's splits, so each knows what it receives (gloo's all_to_all needs sizes on both sides)
        table = np.zeros(self.size * self.size, dtype=np.int64)
        self._gather_bytes(send.view(np.uint8), table.view(np.uint8), 8 * self.size)
        recv[:] = table.reshape(self.size, self.size)[:, self.rank]
        row_bytes = int(np.prod(buf.shape[1:], dtype=np.int64)) * buf.itemsize
        out = np.empty((int(recv.sum()), *buf.shape[1:]), dtype=buf.dtype)
        if row_bytes and (send.sum() or recv.sum()):
            src = self._tensor(self._bytes(buf))
            dst = self._tensor(out.reshape(-1).view(np.uint8))
            self._call("alltoall", self._dist.all_to_all_single, dst, src,
                       output_split_sizes=(recv * row_bytes).tolist(), input_split_sizes=(send * row_bytes).tolist())
            self._back(dst, out.reshape(-1).view(np.uint8))
        return out, [int(r) for r in recv]

    def reducescatter(self, buf: np.ndarray, op: ReduceOp, *, bfloat16: bool = False) -> np.ndarray:
        return reducescatter_by_allreduce(self, buf, op, bfloat16=bfloat16)

    def barrier(self) -> None:
        self.allreduce(np.zeros(1, dtype=np.float32), ReduceOp.SUM)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owns_group and self._dist.is_initialized():
            try:
                self._dist.destroy_process_group()
            except Exception:  # a group whose peers are gone cannot always be torn down cleanly
                pass
        close = getattr(self._store, "close", None)  # a KVTorchStore's connections (a HashStore has none)
        if close is not None:
            close()
