"""The MPI backend: collectives through mpi4py, chosen when the job is started by ``mpirun``.

Every collective is started non-blocking (``Iallreduce``, ``Iallgatherv``, ...) and its request is polled with
short sleeps, so a rank waiting for its peers does not spin a core (Open MPI's blocking calls busy-poll) and a
peer that never arrives raises ``CollectiveTimeoutError`` after ``SPARK_HVD_TIMEOUT`` seconds instead of hanging.

MPI itself cannot say which peer is late, so the backend asks: while it polls, a rank answers "which collective
are you in?" queries on a private communicator with its count of collectives; a rank that times out sends the
query to every peer and waits briefly for the answers. Peers that do not answer (frozen, or busy outside
spark_hvd) or answer with another count (in another collective) are the late ones, and the error names them. A
peer that dies makes ``mpirun`` end the job.

float16 and bfloat16 (a uint16 view) are reduced in float32, which MPI supports everywhere.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from spark_hvd.core.backend import Backend, ReduceOp, alltoall_args, as_rows, reducescatter_by_allreduce
from spark_hvd.core.errors import CollectiveTimeoutError
from spark_hvd.core.reduce import check_dtype, divide_average, reduce_widened
from spark_hvd.core.settings import Settings

_QUERY, _ANSWER = 1, 2  # tags on the diagnosis communicator
_ANSWER_WAIT_S = 2.0  # how long a rank that timed out waits for its peers' answers



class MpiBackend(Backend):
    """Collectives over ``MPI.COMM_WORLD`` (a private duplicate of it, or of ``comm`` when given)."""

    name = "mpi"

    def __init__(self, settings: Settings | None = None, comm: Any = None) -> None:
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise ImportError("the MPI backend needs mpi4py and an MPI library: pip install 'spark_hvd[mpi]'") from exc

        self._mpi = MPI
        self.settings = settings or Settings.from_env()
        self.timeout_s = self.settings.timeout_s
        self.comm = (comm or MPI.COMM_WORLD).Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self._local = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = self._local.Get_rank()
        self.local_size = self._local.Get_size()
        self._cross = self.comm.Split(color=self.local_rank, key=self.rank)
        self.cross_rank = self._cross.Get_rank()
        self.cross_size = self._cross.Get_size()
        self._ops = {ReduceOp.SUM: MPI.SUM, ReduceOp.AVERAGE: MPI.SUM, ReduceOp.MIN: MPI.MIN,
                     ReduceOp.MAX: MPI.MAX, ReduceOp.PRODUCT: MPI.PROD}
        self._diag = self.comm.Dup()  # "which collective are you in?" queries and answers (see module doc)
        self._collectives = 0
        self._closed = False

    def _wait(self, request: Any, what: str) -> None:
        """Poll ``request`` with growing sleeps (no busy core) until done or the timeout; answer peers' queries
        meanwhile. On timeout, raise an error naming the ranks that are not in this collective."""
        self._collectives += 1
        spins = 0
        pause = 50e-6
        deadline = time.monotonic() + self.timeout_s
        while not request.Test():
            spins += 1
            if spins < 200:
                continue
            if time.monotonic() > deadline:
                late, detail = self._late_ranks()
                raise CollectiveTimeoutError(
                    f"MPI {what} on rank {self.rank} waited more than {self.timeout_s:.0f} s for the other ranks "
                    f"(SPARK_HVD_TIMEOUT): {detail}", rank=late[0] if late else None, operation=what)
            self._answer_queries()
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)

    def _answer_queries(self) -> None:
        """Tell every peer that asked which collective this rank is in (its count of collectives)."""
        status = self._mpi.Status()
        while self._diag.Iprobe(self._mpi.ANY_SOURCE, _QUERY, status):
            source = status.Get_source()
            self._diag.Recv(np.empty(1, np.int64), source, _QUERY)
            self._diag.Send(np.array([self._collectives], np.int64), source, _ANSWER)  # 8 bytes: sent eagerly

    def _late_ranks(self, answer_wait_s: float = _ANSWER_WAIT_S) -> tuple[list[int], str]:
        """Ask every peer which collective it is in: (the late ranks, a sentence saying why each is late)."""
        mine = np.array([self._collectives], np.int64)
        peers = [r for r in range(self.size) if r != self.rank]
        for r in peers:
            self._diag.Send(mine, r, _QUERY)
        answers: dict[int, int] = {}
        status = self._mpi.Status()
        got = np.empty(1, np.int64)
        deadline = time.monotonic() + answer_wait_s
        while len(answers) < len(peers) and time.monotonic() < deadline:
            self._answer_queries()  # peers that timed out too are asking at the same time
            if self._diag.Iprobe(self._mpi.ANY_SOURCE, _ANSWER, status):
                source = status.Get_source()
                self._diag.Recv(got, source, _ANSWER)
                answers[source] = int(got[0])
            else:
                time.sleep(1e-3)
        silent = [r for r in peers if r not in answers]
        elsewhere = [r for r in peers if r in answers and answers[r] != self._collectives]
        parts = []
        if silent:
            parts.append(f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} did not answer "
                         f"within {answer_wait_s:.0f} s (stuck outside spark_hvd, or gone)")
        if elsewhere:
            parts.append("; ".join(f"rank {r} is in collective #{answers[r]}, not #{self._collectives}"
                                   for r in elsewhere))
        if not parts:
            parts.append("every rank is in this collective, yet it did not complete")
        return sorted(silent + elsewhere), "; ".join(parts)

    def allreduce(self, buf: np.ndarray, op: ReduceOp, *, bfloat16: bool = False) -> None:
        check_dtype(buf, bfloat16)
        if buf.size == 0:
            return
        if reduce_widened(buf, bfloat16, lambda wide: self._allreduce_native(wide.reshape(-1), op)):
            return
        self._allreduce_native(buf.reshape(-1), op)

    def _allreduce_native(self, flat: np.ndarray, op: ReduceOp) -> None:
        request = self.comm.Iallreduce(self._mpi.IN_PLACE, flat, op=self._ops[op])
        self._wait(request, "allreduce")
        if op is ReduceOp.AVERAGE:
            divide_average(flat, self.size)

    def allgather(self, buf: np.ndarray) -> np.ndarray:
        buf = as_rows(buf)
        rows = np.array([buf.shape[0]], dtype=np.int64)
        all_rows = np.empty(self.size, dtype=np.int64)
        self._wait(self.comm.Iallgather(rows, all_rows), "allgather")
        row_bytes = int(np.prod(buf.shape[1:], dtype=np.int64)) * buf.itemsize
        counts = [int(r) * row_bytes for r in all_rows]
        out = np.empty((int(all_rows.sum()), *buf.shape[1:]), dtype=buf.dtype)
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist()
        request = self.comm.Iallgatherv(buf.reshape(-1).view(np.uint8),
                                        [out.reshape(-1).view(np.uint8), counts, displs, self._mpi.BYTE])
        self._wait(request, "allgather")
        return out

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        if buf.nbytes == 0:
            return
        self._wait(self.comm.Ibcast(buf.reshape(-1).view(np.uint8), root=root), "broadcast")

    def alltoall(self, buf: np.ndarray, splits: Sequence[int] | None = None) -> tuple[np.ndarray, list[int]]:
        buf, splits = alltoall_args(buf, splits, self.size)
        send_splits = np.asarray(splits, dtype=np.int64)
        recv_splits = np.empty(self.size, dtype=np.int64)
        self._wait(self.comm.Ialltoall(send_splits, recv_splits), "alltoall")
        row_bytes = int(np.prod(buf.shape[1:], dtype=np.int64)) * buf.itemsize
        send_counts = (send_splits * row_bytes).tolist()
        recv_counts = (recv_splits * row_bytes).tolist()
        send_displs = np.concatenate([[0], np.cumsum(send_counts)[:-1]]).astype(np.int64).tolist()
        recv_displs = np.concatenate([[0], np.cumsum(recv_counts)[:-1]]).astype(np.int64).tolist()
        out = np.empty((int(recv_splits.sum()), *buf.shape[1:]), dtype=buf.dtype)
        request = self.comm.Ialltoallv([buf.reshape(-1).view(np.uint8), send_counts, send_displs, self._mpi.BYTE],
                                       [out.reshape(-1).view(np.uint8), recv_counts, recv_displs, self._mpi.BYTE])
        self._wait(request, "alltoall")
        return out, [int(r) for r in recv_splits]

    def reducescatter(self, buf: np.ndarray, op: ReduceOp, *, bfloat16: bool = False) -> np.ndarray:
        return reducescatter_by_allreduce(self, buf, op, bfloat16=bfloat16)

    def barrier(self) -> None:
        self._wait(self.comm.Ibarrier(), "barrier")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for comm in (self._diag, self._cross, self._local, self.comm):
            try:
                comm.Free()
            except Exception:  # MPI already finalized at interpreter exit
                pass
