"""Checkpoints between a Ray Tune trial and the ranks of its job (``spark_hvd.ray.tune``).

Rank 0 offers a checkpoint (a ``ray.tune.Checkpoint``: a directory and its filesystem) to the trial over its
authenticated connection to the job's driver service, as a request of the executor's handler ``REQUEST``; the offer
is queued behind rank 0's earlier ``report(...)`` events (one connection keeps them in order), and the trial's
thread hands it to ``ray.tune.report`` when it gets there. Rank 0 then asks, about once a second, whether the trial
has taken it: ``ray.tune.report`` copies a checkpoint into the experiment's storage before it returns, so once the
answer is "done" rank 0 may delete or overwrite its directory. Each ask is answered within a second, so no request
outlives the connection's timeout however long the upload takes.

A checkpoint on a local filesystem is a directory of one node. Where the trial and rank 0 (or, for a restored
checkpoint, a rank and the trial) are on different Ray nodes, ``NodeCheckpoint.local`` copies it: a Ray task on the
node that has it packs it (an uncompressed tar), and it is unpacked into a temporary directory here. A checkpoint
on a remote filesystem (``s3://``, a shared ``storage_path``) is used where it is.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import shutil
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

#: The driver service's request for checkpoints (payload ``{"op": "offer" | "wait", ...}``).
REQUEST = "spark_hvd.ray.checkpoint"
#: Seconds rank 0 waits for the trial to take a checkpoint (``ray.tune.report`` uploads it first).
WAIT_S = 1800.0
#: Seconds one ``wait`` request waits on the driver before it answers "pending".
POLL_S = 1.0


def pack(path: str) -> bytes:
    """The directory ``path`` (its files and folders, not itself) as an uncompressed tar."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist on this node")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in sorted(os.listdir(path)):
            tar.add(os.path.join(path, name), arcname=name)
    return buffer.getvalue()


def unpack(data: bytes, into: str) -> None:
    """Unpack what ``pack`` made into the directory ``into`` (only plain files and folders inside it)."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        tar.extractall(into, filter="data")


def node_id() -> str:
    """The id of the Ray node this process runs on."""
    import ray

    return str(ray.get_runtime_context().get_node_id())


@dataclass(frozen=True)
class NodeCheckpoint:
    """A ``ray.tune.Checkpoint`` and the Ray node it was made on (where its directory is, if local)."""

    checkpoint: Any
    node: str

    def on_remote_filesystem(self) -> bool:
        """Whether the checkpoint's files are on a filesystem every node reaches (not the local one)."""
        return getattr(getattr(self.checkpoint, "filesystem", None), "type_name", "local") != "local"

    @contextlib.contextmanager
    def local(self) -> Iterator[Any]:
        """A checkpoint whose files this process can read: the checkpoint itself on its own node or a remote
        filesystem; elsewhere a copy in a temporary directory, removed when the block ends."""
        if self.node == node_id() or self.on_remote_filesystem():
            yield self.checkpoint
            return
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        task = ray.remote(num_cpus=0, max_retries=0)(pack).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(self.node, soft=False))
        data = ray.get(task.remote(self.checkpoint.path), timeout=WAIT_S)
        into = tempfile.mkdtemp(prefix="shvd-checkpoint-")
        try:
            unpack(data, into)
            yield type(self.checkpoint).from_directory(into)
        finally:
            shutil.rmtree(into, ignore_errors=True)


@dataclass
class Offer:
    """Rank 0's checkpoint, queued for the trial's thread (``RankZeroReports``)."""

    metrics: dict[str, Any]
    checkpoint: NodeCheckpoint
    ticket: int
    taken: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


class Offers:
    """The driver's side of ``REQUEST``: offers by ticket, until the trial took them or the run ended."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tickets = itertools.count(1)
        self._open: dict[int, Offer] = {}

    def make(self, payload: dict[str, Any]) -> Offer:
        """A new offer of ``payload`` (``metrics``, ``checkpoint``, ``node``)."""
        with self._lock:
            offer = Offer(dict(payload["metrics"]), NodeCheckpoint(payload["checkpoint"], str(payload["node"])),
                          next(self._tickets))
            self._open[offer.ticket] = offer
            return offer

    def wait(self, ticket: int) -> str:
        """"done" once the trial took offer ``ticket``, else "pending" after up to ``POLL_S``; raises where the
        trial failed to take it (the rank sees the message)."""
        with self._lock:
            offer = self._open.get(ticket)
        if offer is None:
            raise KeyError(f"no checkpoint offer {ticket} (the run ended?)")
        if not offer.taken.wait(POLL_S):
            return "pending"
        with self._lock:
            self._open.pop(ticket, None)
        if offer.error is not None:
            raise RuntimeError(offer.error)
        return "done"

    def fail_all(self, why: str) -> None:
        """The run ended: every offer not taken fails with ``why``."""
        with self._lock:
            for offer in self._open.values():
                if not offer.taken.is_set():
                    offer.error = why
                    offer.taken.set()


def offer(metrics: dict[str, Any], checkpoint: Any) -> None:
    """On rank 0: hand ``checkpoint`` with ``metrics`` to the trial and wait until it took it (``WAIT_S`` at
    most). Raises ``RuntimeError`` outside a rank of a ``RayExecutor`` job, or where the trial refused it."""
    from spark_hvd.runner.client import current_client

    client = current_client()
    if client is None:
        raise RuntimeError("spark_hvd.ray.tune.report(checkpoint=...): this process is not a rank of a RayExecutor "
                           "job (no connection to the job's driver service)")
    plain = {str(k): (v.item() if callable(getattr(v, "item", None)) else v) for k, v in metrics.items()}
    ticket = client.request(REQUEST, {"op": "offer", "metrics": plain, "checkpoint": checkpoint,
                                      "node": node_id()})
    deadline = time.monotonic() + WAIT_S
    while client.request(REQUEST, {"op": "wait", "ticket": ticket}) != "done":
        if time.monotonic() > deadline:
            raise TimeoutError(f"spark_hvd.ray.tune.report: the trial did not take checkpoint {checkpoint} within "
                               f"{WAIT_S:g} s")
