"""The backend of a single-process job (size 1): every collective is a local copy or nothing, no sockets."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from spark_hvd.core.backend import Backend, ReduceOp, alltoall_args


class LocalBackend(Backend):
    """Collectives over one rank. Used when a process is started without any launcher environment."""

    name = "local"
    fuses_in_place = True  # one rank: every array already holds its result

    def __init__(self) -> None:
        self.rank = 0
        self.size = 1
        self.local_rank = 0
        self.local_size = 1
        self.cross_rank = 0
        self.cross_size = 1

    def allreduce(self, buf: np.ndarray, op: ReduceOp, *, bfloat16: bool = False) -> None:
        """The reduction of one contribution is the contribution itself (AVERAGE divides by 1)."""

    def allreduce_fused(self, bufs: Sequence[np.ndarray], op: ReduceOp, *, bfloat16: bool = False) -> None:
        """Nothing to move: every array already holds the result."""

    def allgather(self, buf: np.ndarray) -> np.ndarray:
        return np.array(buf, copy=True)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        if root != 0:
            raise ValueError(f"broadcast root {root} does not exist in a job of size 1")

    def alltoall(self, buf: np.ndarray, splits: Sequence[int] | None = None) -> tuple[np.ndarray, list[int]]:
        _, counts = alltoall_args(buf, splits, 1)  # checks the splits; a scalar keeps its shape here
        return np.array(buf, copy=True), counts

    def reducescatter(self, buf: np.ndarray, op: ReduceOp, *, bfloat16: bool = False) -> np.ndarray:
        return np.array(buf, copy=True)

    def barrier(self) -> None:
        """One rank is always at the barrier."""

    def close(self) -> None:
        """Nothing to release."""
