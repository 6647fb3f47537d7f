"""Framework-neutral pieces shared by the bindings (``spark_hvd.torch``, ``spark_hvd.keras``,
``spark_hvd.tensorflow``, ``spark_hvd.mxnet``).

Everything here speaks numpy and the core's process API; nothing imports torch, tensorflow or mxnet.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

import spark_hvd.core as _core
from spark_hvd.core import process_sets
from spark_hvd.core.backend import Adasum, Average, Max, Min, Product, ReduceOp, Sum  # noqa: F401 - Horovod's names
from spark_hvd.core.context import add_process_set, remove_process_set  # noqa: F401 - re-exported (Horovod's API)
from spark_hvd.core.errors import NotInitializedError, SparkHvdError
from spark_hvd.core.process_sets import ProcessSet, global_process_set  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

# Horovod's name of the error a failed collective raises (``except hvd.HorovodInternalError``)
HorovodInternalError = SparkHvdError



def core() -> Any:
    """The core's process API, ``spark_hvd.core`` (imported with this module: the core package loads its process
    API as soon as any of its modules is imported, so a late import here would save nothing)."""
    return _core


def require_init(what: str) -> None:
    """Raise :class:`NotInitializedError` naming ``what`` unless ``init()`` has been called."""
    if not core().is_initialized():
        raise NotInitializedError(what)


def check_member(process_set: ProcessSet | None, what: str) -> None:
    """Raise ``ValueError`` now (not inside a TensorFlow graph op) unless this rank may run ``what`` on
    ``process_set`` (registered, and this rank a member)."""
    process_sets.resolve(process_set, what, rank())


# ---- process API shared by both bindings ----

def shutdown() -> None:
    """Leave the job and stop the core's background engine."""
    core().shutdown()


def is_initialized() -> bool:
    """True between :func:`init` and :func:`shutdown`."""
    return bool(core().is_initialized())


def rank() -> int:
    """This process's rank in the job."""
    return core().rank()


def size() -> int:
    """Number of processes in the job."""
    return core().size()


def local_rank() -> int:
    """Rank among the processes of this host."""
    return core().local_rank()


def local_size() -> int:
    """Number of processes on this host."""
    return core().local_size()


def cross_rank() -> int:
    """Index of this host among the job's hosts."""
    return core().cross_rank()


def cross_size() -> int:
    """Number of hosts in the job."""
    return core().cross_size()


def set_rank(process_set: ProcessSet | None = None) -> int:
    """This rank's index in ``process_set`` (its global rank for the global set)."""
    if process_set is None or process_set.process_set_id == 0:
        return rank()
    return int(process_set.rank())


def set_size(process_set: ProcessSet | None = None) -> int:
    """The number of ranks in ``process_set`` (the job's size for the global set)."""
    if process_set is None or process_set.process_set_id == 0:
        return size()
    return int(process_set.size())


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank (of ``process_set``) has called it."""
    require_init("barrier()")
    core().barrier(process_set=process_set)


def join(device: int = -1) -> int:
    """Say this rank has no more data; returns, once every rank has joined, the last rank to join.

    Until then this rank takes part in the other ranks' allreduces with zeros, so ranks with different
    numbers of batches finish instead of hanging. ``device`` is accepted for Horovod compatibility.
    """
    require_init("join()")
    return int(core().join())


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Root's picklable ``obj`` (``root_rank`` a global rank), on every rank (of ``process_set``)."""
    require_init("broadcast_object()")
    return core().broadcast_object(obj, root_rank=root_rank, name=name, process_set=process_set)


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every rank's picklable ``obj``, as a list by rank (of ``process_set``)."""
    require_init("allgather_object()")
    return core().allgather_object(obj, name=name, process_set=process_set)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing the engine's Chrome-trace timeline to ``file_path`` (rank 0 only, unless the path holds
    ``{rank}``), replacing any timeline being written. Call it on every rank. ``mark_cycles`` is accepted for
    Horovod compatibility; the engine's ``ROUND`` events mark its cycles always. The activity names are
    spark_hvd's (see ``spark_hvd.core.engine.timeline``), not Horovod's."""
    require_init("start_timeline()")
    from spark_hvd.core.engine.timeline import Timeline, timeline_path

    if not file_path or file_path == "DYNAMIC":
        raise ValueError(f"start_timeline needs a file path, got {file_path!r}")
    engine = core().get_engine()
    path = timeline_path(file_path, rank())
    old, engine.timeline = engine.timeline, (Timeline(path, rank()) if path else None)
    if old is not None:
        old.close()  # the engine thread may still hold it: a closed timeline ignores events


def stop_timeline() -> None:
    """Stop writing the timeline started by :func:`start_timeline` (or ``HOROVOD_TIMELINE``) and close it."""
    require_init("stop_timeline()")
    timeline = core().get_engine().timeline
    if timeline is not None:
        timeline.close()  # left in place, closed: the engine thread may be about to record an event on it


def mpi_threads_supported() -> bool:
    """Horovod compatibility: spark_hvd does not run user code on MPI threads."""
    return False


def mpi_built() -> bool:
    """True when mpi4py is importable (the core's MPI backend is then available under mpirun)."""
    import importlib.util

    return importlib.util.find_spec("mpi4py") is not None


def gloo_built() -> bool:
    """Horovod compatibility: the built-in TCP ring plays gloo's part and is always there."""
    return True


def mpi_enabled() -> bool:
    """True when this job runs on the MPI backend (launched by ``mpirun``)."""
    return is_initialized() and core().backend_name() == "mpi"


def gloo_enabled() -> bool:
    """True when this job runs on spark_hvd's own TCP ring, which plays gloo's part (Horovod's meaning: not MPI)."""
    return is_initialized() and core().backend_name() in ("ring", "local")


def ccl_built() -> bool:
    """Horovod compatibility: there is no oneCCL support."""
    return False


def ddl_built() -> bool:
    """Horovod compatibility: there is no IBM DDL support."""
    return False


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks."""
    require_init("is_homogeneous()")
    return size() == local_size() * cross_size()


def resolve_op(op: ReduceOp | None, average: bool | None = None) -> ReduceOp:
    """Horovod's ``average=`` (deprecated) and ``op=`` arguments resolved to one :class:`ReduceOp`."""
    if op is not None and average is not None:
        raise ValueError("pass either op= or the deprecated average=, not both")
    if op is None:
        if average is None or average:
            return ReduceOp.AVERAGE
        return ReduceOp.SUM
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return ReduceOp(op.lower())
        except ValueError:
            pass
    raise ValueError(f"unsupported reduction op {op!r}; use one of Average, Sum, Min, Max, Product, Adasum")


def gradient_scales(op: ReduceOp, gradient_predivide_factor: float) -> tuple[float, float]:
    """Prescale and postscale factors that split an Average between before and after the sum.

    The core's AVERAGE divides by ``size`` after the sum; a predivide factor ``f`` divides by ``f`` before
    and multiplies by ``f`` after, which keeps fp16 sums in range on large jobs (Horovod's semantics).
    """
    if gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
    if gradient_predivide_factor != 1.0 and op is not ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor needs op=Average")
    if op is ReduceOp.AVERAGE:
        return 1.0 / gradient_predivide_factor, gradient_predivide_factor
    return 1.0, 1.0


def is_bfloat16_dtype(dtype: np.dtype) -> bool:
    """True for the ml_dtypes / TensorFlow ``bfloat16`` numpy dtype."""
    return np.dtype(dtype).name == "bfloat16"


def to_core_buffer(arr: np.ndarray) -> tuple[np.ndarray, bool]:
    """A view of ``arr`` the core can reduce: bfloat16 becomes a uint16 view plus ``bfloat16=True``."""
    if is_bfloat16_dtype(arr.dtype):
        return arr.view(np.uint16), True
    return arr, False


def gpu_index(device_count: int) -> int | None:
    """The GPU this rank uses, by the one GPU policy (``spark_hvd.core.jobenv.gpu_index``): the GPU Spark
    assigned to the task (``SPARK_HVD_GPU``), else the local rank; None when that local rank has no GPU.
    Raises ``ValueError`` naming the rank when an assigned GPU is not visible (never wrapped around), or when
    ``SPARK_HVD_DEVICE_BACKEND=nccl`` asks for NCCL and this rank has no GPU."""
    from spark_hvd.core.jobenv import gpu_index as policy

    c = core()
    required = (c.settings().device_backend or "").strip().lower() == "nccl"
    return policy(c.job_env(), device_count, required=required)


# ---- host buffers a framework can take over without a copy ----

#: the alignment host buffers handed to a framework start on (TensorFlow's Eigen kernels assume 64 bytes,
#: EIGEN_MAX_ALIGN_BYTES; MXNet's CPU kernels are content with it too)
ALIGN = 64


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an ``ALIGN``-byte boundary (numpy's own start on a
    16-byte one, so a whole number of items reaches the next ``ALIGN`` boundary; on the small-tensor path of every
    collective, hence written for speed)."""
    count = math.prod(shape)
    raw = np.empty(count + max(ALIGN // np.dtype(dtype).itemsize, 1), dtype)
    start = (-raw.ctypes.data) % ALIGN // raw.itemsize
    out = raw[start:start + count]
    return out if len(shape) == 1 else out.reshape(shape)


def packed(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """``arrays`` (one dtype) copied into one flat aligned buffer, each at an aligned offset (zeros between them),
    and the views of their places in it, shaped as they are: one allreduce of the flat buffer reduces them all."""
    item = arrays[0].dtype.itemsize
    step = max(ALIGN // item, 1)
    offsets, end = [], 0
    for a in arrays:
        offsets.append(end)
        end += -(-a.size // step) * step
    flat = aligned_empty((end,), arrays[0].dtype)
    views = []
    for a, at, stop in zip(arrays, offsets, [*offsets[1:], end], strict=True):
        flat[at:at + a.size] = a.reshape(-1)
        flat[at + a.size:stop] = 0
        views.append(flat[at:at + a.size].reshape(a.shape))
    return flat, views
