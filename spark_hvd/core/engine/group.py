"""The one interface a negotiated round's collectives run on, and its host implementation over a ``Backend``.

Horovod's ``OperationManager`` shape: the engine decides *what* runs (the negotiation table), the executor
(``spark_hvd.core.engine.executor``) runs it on a ``Group`` and never asks which one. Host arrays go to a ``HostGroup``
(the job's backend: the built-in ring, MPI, torch.distributed); tensors on a device go to a ``DeviceGroup``
(``spark_hvd.core.engine.device``: NCCL, gloo standing in on CPU). Both reduce several buffers as one collective and
scale them around it; what differs (packing into a fusion buffer, or a backend that reduces many arrays where they
lie) stays inside the group.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from spark_hvd.core.algorithms import adasum
from spark_hvd.core.backend import Backend, ReduceOp
from spark_hvd.core.engine.negotiation import reduction_identity
from spark_hvd.core.errors import SparkHvdError
from spark_hvd.core.reduce import scale_inplace

DIRECT_BYTES = 4 * 1024 * 1024  # a host tensor this large is reduced on its own: packing it costs more than it saves

Phases = Sequence[tuple[str, float, float]]  # (timeline activity, start, end) of one allreduce


class Group(ABC):
    """Collectives on the buffers of one place (host memory, or one device kind), the engine thread's only.

    ``device``: "" for host memory, else the device kind. ``fuses_in_place``: the group reduces many buffers where
    they lie, so a round's tensors of one kind go in one collective whatever the fusion threshold (it bounds a
    fusion buffer, and there is none). ``direct_bytes``: tensors this large are reduced on their own, not fused.
    """

    device: str = ""
    fuses_in_place: bool = False
    direct_bytes: float = float("inf")

    @abstractmethod
    def allreduce(self, bufs: Sequence[Any], op: ReduceOp, prescale: float, postscale: float,
                  bfloat16: bool = False) -> Phases | None:
        """Reduce the buffers in place as one collective (fused when there are several); returns its phases for
        the timeline, or None (one ``ALLREDUCE`` phase, timed by the caller)."""

    @abstractmethod
    def allgather(self, buf: Any) -> Any:
        """Every rank's rows concatenated (the first dimension may differ by rank): a new array / tensor."""

    @abstractmethod
    def broadcast(self, buf: Any, root: int) -> None:
        """Root's data into ``buf`` on every rank, in place."""

    @abstractmethod
    def alltoall(self, buf: Any, splits: Sequence[int]) -> tuple[Any, list[int]]:
        """``splits[i]`` rows to rank i; returns the rows received and how many from each rank."""

    @abstractmethod
    def reducescatter(self, buf: Any, op: ReduceOp, prescale: float, postscale: float,
                      bfloat16: bool = False) -> Any:
        """This rank's rows of the reduction (the reducescatter split): a new array / tensor."""

    @abstractmethod
    def placeholder(self, shape: tuple[int, ...], dtype: np.dtype, bfloat16: bool, op: str) -> Any:
        """What a joined rank contributes: the identity of ``op``."""

    def barrier(self) -> None:
        """Return once every rank has called it."""
        raise SparkHvdError(f"barrier is not a collective on {self.device or 'host'} tensors")

    def allreduce_staged(self, staging: np.ndarray, op: ReduceOp, beside: np.ndarray | None = None) -> None:
        """One allreduce of a staging array as it is, in place, no scaling: a fast round's vector, a speculation's
        ``[flag, tensors...]``, a fresh round's ``[flag, digests, tensors...]``; ``beside``: a tensor reduced where
        it lies in the same collective (an in-place speculation's)."""
        raise SparkHvdError(f"a staged allreduce is not a collective on {self.device or 'host'} tensors")

    def allreduce_agreed(self, buf: np.ndarray, op: ReduceOp, agree: bool) -> bool:
        """``Backend.allreduce_agreed``: reduce ``buf`` in place if every rank ``agree``s; whether they all did."""
        raise SparkHvdError(f"an agreed allreduce is not a collective on {self.device or 'host'} tensors")

    def leave_together(self) -> None:  # noqa: B027 - nothing to wait for by default
        """``Backend.leave_together``: after a staged collective that completed a barrier."""

    def result(self, buf: Any) -> Any:
        """What a handle of an in-place collective (allreduce, broadcast) of ``buf`` returns."""
        return buf

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Release what the group holds. Safe to call twice."""


class HostGroup(Group):
    """Host arrays on the job's backend. Where the backend does not reduce many arrays where they lie, several
    tensors are packed into a reusable fusion buffer (one per dtype) and reduced as one."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.fuses_in_place = backend.fuses_in_place
        self.direct_bytes = float("inf") if self.fuses_in_place else DIRECT_BYTES
        self._fusion_buffers: dict[str, np.ndarray] = {}
        # ``Group.allreduce_agreed`` is the backend's own (a speculative round's one call, no frame between)
        self.allreduce_agreed = backend.allreduce_agreed  # type: ignore[method-assign]

    def allreduce(self, bufs: Sequence[np.ndarray], op: ReduceOp, prescale: float, postscale: float,
                  bfloat16: bool = False) -> Phases:
        backend = self.backend
        if op is ReduceOp.ADASUM:  # not element-wise: its own algorithm over the backend's collectives
            return adasum.group_allreduce(backend, bufs, prescale, postscale, bfloat16)
        if len(bufs) == 1 or self.fuses_in_place:
            if prescale != 1.0:
                for buf in bufs:
                    scale_inplace(buf, prescale, bfloat16)
            t0 = time.perf_counter()
            if len(bufs) == 1:
                backend.allreduce(bufs[0], op, bfloat16=bfloat16)
            else:
                backend.allreduce_fused(bufs, op, bfloat16=bfloat16)
            t1 = time.perf_counter()
            if postscale != 1.0:
                for buf in bufs:
                    scale_inplace(buf, postscale, bfloat16)
            return (("ALLREDUCE", t0, t1),)
        fusion = self._fusion_buffer(bufs[0].dtype, sum(b.size for b in bufs))
        t0 = time.perf_counter()
        offset = 0
        for buf in bufs:
            fusion[offset:offset + buf.size] = buf.reshape(-1)
            offset += buf.size
        scale_inplace(fusion, prescale, bfloat16)
        t1 = time.perf_counter()
        backend.allreduce(fusion, op, bfloat16=bfloat16)
        t2 = time.perf_counter()
        scale_inplace(fusion, postscale, bfloat16)
        offset = 0
        for buf in bufs:
            buf.reshape(-1)[...] = fusion[offset:offset + buf.size]
            offset += buf.size
        t3 = time.perf_counter()
        return (("MEMCPY_IN_FUSION_BUFFER", t0, t1), ("ALLREDUCE", t1, t2), ("MEMCPY_OUT_FUSION_BUFFER", t2, t3))

    def _fusion_buffer(self, dtype: np.dtype, count: int) -> np.ndarray:
        buf = self._fusion_buffers.get(dtype.str)
        if buf is None or buf.size < count:
            buf = self._fusion_buffers[dtype.str] = np.empty(count, dtype)
        return buf[:count]

    def allgather(self, buf: np.ndarray) -> np.ndarray:
        return self.backend.allgather(buf)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        self.backend.broadcast(buf, root)

    def alltoall(self, buf: np.ndarray, splits: Sequence[int]) -> tuple[np.ndarray, list[int]]:
        out, recv = self.backend.alltoall(buf, splits)
        return out, list(recv)

    def reducescatter(self, buf: np.ndarray, op: ReduceOp, prescale: float, postscale: float,
                      bfloat16: bool = False) -> np.ndarray:
        work = buf.copy() if prescale != 1.0 else buf
        scale_inplace(work, prescale, bfloat16)
        result = self.backend.reducescatter(work, op, bfloat16=bfloat16)
        scale_inplace(result, postscale, bfloat16)
        return result

    def placeholder(self, shape: tuple[int, ...], dtype: np.dtype, bfloat16: bool, op: str) -> np.ndarray:
        return reduction_identity(shape, dtype, op, bfloat16)

    def barrier(self) -> None:
        self.backend.barrier()

    def allreduce_staged(self, staging: np.ndarray, op: ReduceOp, beside: np.ndarray | None = None) -> None:
        if beside is None:
            self.backend.allreduce(staging, op)
        else:
            self.backend.allreduce_fused([staging, beside], op)


    def leave_together(self) -> None:
        self.backend.leave_together()
