"""Tensors that live on a device (CUDA), and the group that reduces them where they lie.

A framework binding hands the engine a ``DeviceBuffer`` (the tensor itself, no host copy) instead of a numpy array
when ``device_key`` says so. The engine negotiates it exactly like a host array (its ``Meta`` carries the device
kind, so one name submitted on the GPU by some ranks and in host memory by others is a ``TensorMismatchError``
naming them), fuses ready allreduces per device kind, and runs them on a ``DeviceGroup`` instead of its backend.

The group is set up lazily, by the engine thread, at the first device collective that every rank has submitted:
all ranks reach that point in the same round, so the setup (one small exchange over the job's own authenticated
backend, then ``torch.distributed`` over NCCL) is itself in step, and a job that never reduces a CUDA tensor (a
Keras job on GPUs, a numpy job) never imports torch or opens a communicator.

``SPARK_HVD_DEVICE_BACKEND`` (``Settings.device_backend``): unset: NCCL for CUDA tensors; ``none``: CUDA tensors
go through host memory and the ring, as before; ``gloo``: gloo serves the device path, and CPU torch tensors take
it too. That last one is the CPU stand-in for NCCL which tests the whole device plumbing on every CI run.

Process sets: each set's engine opens a group of its own members only (``GroupScope``), lazily in the same way, at
its first device collective. It is an independent group, not ``torch.distributed.new_group`` (which is collective
over every rank of the default group, non-members included, and would force every rank to take part in every
set's setup in one order): its members meet through their own namespace of the KV store (the set's job id
``<job>.ps<id>``, the attempt and a generation), so no other rank and no other group is involved, and sets may be
added, used and removed in any order Horovod's API allows. Removing the set closes its group.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.engine.group import Group
from spark_hvd.core.jobenv import JobEnv

DEVICE_BACKENDS = ("nccl", "gloo", "none")


class DeviceBuffer:
    """A framework tensor on a device, as the engine carries it.

    ``device`` is the device *kind* every rank must agree on (``"cuda"``; ``"cpu"`` for the gloo stand-in), not
    the ordinal (each rank has its own GPU). ``dtype`` is the numpy equivalent used in negotiation (bfloat16: a
    uint16 view with ``bfloat16=True``, as for host arrays). ``ready`` is what the engine waits for before reading
    the tensor (a CUDA event recorded on the producing stream), or None.
    """

    __slots__ = ("tensor", "device", "dtype", "shape", "size", "bfloat16", "ready")

    def __init__(self, tensor: Any, device: str, dtype: np.dtype, shape: tuple[int, ...], bfloat16: bool = False,
                 ready: Any = None) -> None:
        self.tensor = tensor
        self.device = device
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(s) for s in shape)
        self.size = math.prod(self.shape)  # number of elements (read several times per collective: computed once)
        self.bfloat16 = bfloat16
        self.ready = ready

    @property
    def nbytes(self) -> int:
        """Bytes of data."""
        return self.size * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"DeviceBuffer(device={self.device!r}, dtype={self.dtype}, shape={self.shape})"


def device_key(device_type: str, device_backend: str | None) -> str | None:
    """The engine's device kind for a tensor on ``device_type``, or None when it goes through host memory.

    ``device_backend`` is ``Settings.device_backend``: None (default): CUDA tensors take the device path;
    ``"none"``: nothing does; ``"gloo"``/``"nccl"``: CUDA tensors do, and with ``"gloo"`` CPU tensors too.
    """
    backend = check_device_backend(device_backend)
    if backend == "none":
        return None
    if device_type == "cuda":
        return "cuda"
    if backend == "gloo" and device_type == "cpu":
        return "cpu"
    return None


def check_device_backend(value: str | None) -> str | None:
    """``value`` lower-cased, or ``ValueError`` naming ``SPARK_HVD_DEVICE_BACKEND`` when it is not one we know."""
    if value is None:
        return None
    value = value.strip().lower()
    if value not in DEVICE_BACKENDS:
        raise ValueError(f"SPARK_HVD_DEVICE_BACKEND={value!r} is not one of {', '.join(DEVICE_BACKENDS)}")
    return value


@dataclass(frozen=True)
class GroupScope:
    """Whose device group an engine opens: the whole job (``process_set`` 0) or a process set's members.

    ``ranks``: the global ranks of the group's members, in the group's rank order (an engine's rank ``i`` is global
    rank ``ranks[i]``; error messages name global ranks, as Horovod does). ``job``: this rank's launch contract in
    the whole job as ``init()`` read it once (the GPU policy reads its rank, local rank and assigned GPU, never the
    set's own numbering; the device group's store, its job's services); None where none was passed (an engine
    built on a backend directly: the backend's topology alone).
    """

    process_set: int
    ranks: tuple[int, ...]
    job: JobEnv | None = None

    def label(self, rank: int) -> str:
        """``"rank 2"``, or ``"rank 2 (process set 1, ranks [1, 2])"``: the global rank of the group's ``rank``."""
        where = f"rank {self.ranks[rank]}"
        return where if not self.process_set else f"{where} (process set {self.process_set}, ranks {list(self.ranks)})"

    def global_ranks(self, ranks: Sequence[int]) -> list[int]:
        """The group's ``ranks`` as global ranks."""
        return [self.ranks[r] for r in ranks]


class DeviceGroup(Group):
    """Collectives on ``DeviceBuffer`` tensors of one device kind, where they lie (the engine thread's only).

    The executor runs them through ``spark_hvd.core.engine.group.Group``, the interface host arrays share; ``bfloat16``
    arguments are ignored here (a ``DeviceBuffer`` carries its own). ``rank`` / ``size``: this rank's place in the
    group and the group's size (a process set's own numbering); ``scope``: whose group it is; ``closed``: whether
    ``close`` has run.
    """

    device: str
    rank: int
    size: int
    scope: GroupScope
    closed: bool

    @abstractmethod
    def allreduce(self, bufs: Sequence[DeviceBuffer], op: ReduceOp, prescale: float, postscale: float,
                  bfloat16: bool = False) -> None:
        """Reduce the buffers in place as one collective (fused when there are several)."""

    @abstractmethod
    def reducescatter(self, buf: DeviceBuffer, op: ReduceOp, prescale: float, postscale: float,
                      bfloat16: bool = False) -> Any:
        """This rank's rows of the reduction (the reducescatter split): a new tensor."""

    @abstractmethod
    def placeholder(self, shape: tuple[int, ...], dtype: np.dtype, bfloat16: bool, op: str) -> DeviceBuffer:
        """What a joined rank contributes: the identity of ``op`` (zeros for the kinds that only move data)."""

    def result(self, buf: DeviceBuffer) -> Any:
        """The framework tensor itself."""
        return buf.tensor

    @abstractmethod
    def close(self) -> None:
        """Release the communicator. Safe to call twice."""
