"""Chrome-trace timeline of the engine (``SPARK_HVD_TIMELINE=path``), readable by Perfetto and chrome://tracing.

The file is a JSON array of trace events, written as the engine runs and closed with ``]`` on shutdown (the
array format tolerates a missing ``]`` if the process dies, so a crashed run still opens). Each tensor gets its
own row (thread) named after it; its activities are complete (``"ph": "X"``) events:

- ``WAIT_FOR_NEGOTIATION``: from ``enqueue`` until the engine takes the tensor into a negotiation round;
- ``NEGOTIATE``: from that round until every rank has the tensor ready (the response);
- ``MEMCPY_IN_FUSION_BUFFER`` / ``MEMCPY_OUT_FUSION_BUFFER``: packing into and out of the fusion buffer;
- ``ALLREDUCE``, ``ALLGATHER``, ``BROADCAST``, ``ALLTOALL``, ``REDUCESCATTER``, ``BARRIER``: the collective.

Row 0 (``engine``) holds one ``ROUND`` event per negotiation round. Only rank 0 writes unless the path contains
``{rank}``, which is replaced by each rank's number.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

logger = logging.getLogger(__name__)


def timeline_path(path: str, rank: int) -> str | None:
    """Where ``rank`` writes its timeline, or ``None`` when it writes none (``DYNAMIC``, Horovod's "started later
    by ``start_timeline()``", writes none at start)."""
    if path == "DYNAMIC":
        return None
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    return path if rank == 0 else None


class Timeline:
    """Writes trace events of one rank to ``path``. Thread-safe; ``close()`` is idempotent."""

    def __init__(self, path: str, rank: int = 0) -> None:
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self.path = path
        self.rank = rank
        self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._file.write("[\n")
        self._lock = threading.Lock()
        self._tids: dict[str, int] = {}
        self._first = True
        self._origin = time.perf_counter()
        self._closed = False
        self._write({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        self._write({"name": "thread_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": "engine"}})

    def _us(self, t: float) -> float:
        return round((t - self._origin) * 1e6, 3)

    def _write(self, event: dict) -> None:
        text = json.dumps(event, separators=(",", ":"))
        if self._first:
            self._file.write(text)
            self._first = False
        else:
            self._file.write(",\n" + text)

    def _tid(self, tensor: str) -> int:
        tid = self._tids.get(tensor)
        if tid is None:
            tid = self._tids[tensor] = len(self._tids) + 1
            self._write({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": tensor}})
        return tid

    def event(self, tensor: str | None, activity: str, start: float, end: float, **args: object) -> None:
        """Record ``activity`` of ``tensor`` (``None``: the engine row) between two ``perf_counter`` times."""
        with self._lock:
            if self._closed:
                return
            tid = 0 if tensor is None else self._tid(tensor)
            event = {"name": activity, "ph": "X", "pid": self.rank, "tid": tid,
                     "ts": self._us(start), "dur": round(max(end - start, 0.0) * 1e6, 3)}
            if args:
                event["args"] = args
            self._write(event)

    def flush(self) -> None:
        with self._lock:
            if not self._closed:
                self._file.flush()

    def close(self) -> None:
        """Finish the JSON array and close the file."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._file.write("\n]\n")
                self._file.close()
            except OSError as exc:  # a full disk must not break shutdown
                logger.warning("could not finish the timeline %s: %s", self.path, exc)
