"""Elastic training, the framework-neutral part: ``State``, ``ObjectState``, ``ElasticSampler``, ``run_fn``.

Horovod's elastic API (``hvd.elastic.run``, ``state.commit()`` / ``restore()`` / ``sync()``,
``check_host_updates()``, reset callbacks) over the spark_hvd core. On Spark a barrier stage cannot lose or gain a
task, so every reset is a relaunch (``spark_hvd.runner.run_elastic``): when a rank is lost the stage fails, the
driver starts a new one with the slots that are free, and each rank's first ``sync()`` starts from the state rank 0
last committed. That state lives on the driver's local disk: at every ``commit()`` rank 0 streams it in bounded
chunks through a ``DriverLink`` (installed by the runner, which implements it over its authenticated driver
service; ``core`` only defines it), so its size is not limited by the driver's memory or the service's frames.
Without a link (plain ``run``, ``spark-hvd-run``) a ``State`` keeps its commits in memory only.

Growth: the driver answers each commit with whether more slots are free than the job uses (below
``max_num_proc``); the ranks agree on it with one allreduce, so every rank raises ``HostsUpdatedInterrupt`` in the
same step, the stage ends cleanly and the driver relaunches it bigger.

``core`` imports no framework: ``TorchState`` (``spark_hvd.torch.elastic``) and ``KerasState``
(``spark_hvd.keras.elastic``) add the model and optimizer handling on top of ``ObjectState``.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import random
import secrets
import threading
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any, Protocol

import numpy as np

from spark_hvd.core import state_stream
from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.errors import SparkHvdError

#: Optional cap on a committed state's size in bytes (default: none; the state streams in chunks of
#: ``state_stream.CHUNK_BYTES`` and the driver keeps it on its local disk, not in memory).
STATE_MAX_ENV = "SPARK_HVD_ELASTIC_STATE_MAX"


class HostsUpdatedInterrupt(SparkHvdError):  # noqa: N818 - Horovod's name
    """Raised on every rank, in the same step, when the job can grow (more free slots than ranks, below max).

    ``skip_sync`` is Horovod's flag (True when hosts were only removed, so no state needs syncing); under spark_hvd
    the stage ends and is relaunched, so it is always False.
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the job can grow: more task slots are free than it uses; every rank stops at this commit "
                         "and the driver relaunches the stage bigger")
        self.skip_sync = skip_sync


class StateTooLargeError(SparkHvdError):
    """The committed state is larger than ``SPARK_HVD_ELASTIC_STATE_MAX`` allows."""


class DriverLink(Protocol):
    """Where a rank's committed state goes and where a relaunched job finds it (the runner implements it).

    A commit is a sequence of ``put`` chunks under one ``commit_id`` then ``commit``; the previous commit stays
    the committed one until ``commit`` succeeds, so a rank lost mid-upload leaves the last whole commit.
    """

    def put(self, commit_id: str, seq: int, data: bytes) -> None:
        """Append chunk ``seq`` (0, 1, ...) of the commit ``commit_id`` being uploaded."""

    def commit(self, commit_id: str, sizes: list[int]) -> bool:
        """Make the uploaded chunks (parts of ``sizes`` bytes, back to back) the committed state; True when the job
        can grow."""

    def committed(self) -> list[int] | None:
        """The part sizes of the last committed state of an earlier attempt, or None (nothing committed)."""

    def get(self, offset: int, nbytes: int) -> bytes:
        """Up to ``nbytes`` of the committed state from ``offset``."""

    def hosts_updated(self) -> bool:
        """True when more slots are free than the job uses (and it is below its max)."""


_link: DriverLink | None = None
_link_lock = threading.Lock()


def set_link(link: DriverLink | None) -> None:
    """Install (or clear) this process's driver link; ``spark_hvd.runner.run_elastic`` does it in every rank."""
    global _link
    with _link_lock:
        _link = link


def get_link() -> DriverLink | None:
    """The driver link of this process, or None outside ``run_elastic``."""
    with _link_lock:
        return _link


def state_max_bytes() -> int | None:
    """The cap on a committed state's size (``SPARK_HVD_ELASTIC_STATE_MAX`` bytes), None when not set."""
    raw = os.environ.get(STATE_MAX_ENV)
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{STATE_MAX_ENV}={raw!r} is not a number of bytes") from None
    return value if value > 0 else None


def upload_state(link: DriverLink, value: Any) -> bool:
    """Stream ``value`` to the driver through ``link`` and commit it; True when the job can grow."""
    parts = state_stream.encode(value)
    total = sum(part.nbytes for part in parts)
    cap = state_max_bytes()
    if cap is not None and total > cap:
        raise StateTooLargeError(
            f"rank 0: the committed elastic state is {total} bytes, above {STATE_MAX_ENV}={cap}; raise or unset it, "
            "or keep large objects (datasets, caches) out of the State")
    commit_id = secrets.token_hex(8)
    sizes = state_stream.upload(parts, lambda seq, data: link.put(commit_id, seq, data))
    return link.commit(commit_id, sizes)


def download_state(link: DriverLink) -> Any | None:
    """The value last committed through ``link`` (by an earlier attempt), or None."""
    sizes = link.committed()
    return None if sizes is None else state_stream.download(sizes, link.get)


def _core() -> Any:
    import spark_hvd.core as core

    return core


class State:
    """State kept in step across the ranks of an elastic job (Horovod's ``hvd.elastic.State``).

    Subclasses define ``save()`` (snapshot to host memory), ``restore()`` (back to the snapshot), ``sync()``
    (broadcast from rank 0) and ``snapshot()`` / ``load_snapshot()`` (the snapshot as a picklable value, for the
    driver).
    """

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []
        self._link_checked = False
        self.was_reset = False

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Functions to call after a reset (the job restarted, possibly at another size), e.g. to rescale the
        learning rate to ``hvd.size()``. Under ``run_elastic`` they run on every rank after the committed state was
        restored, at the start of every attempt after the first."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run ``reset()`` then the registered reset callbacks."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Snapshot the state (``save()``); under ``run_elastic`` rank 0 also streams it to the driver, where a
        relaunched job finds it. Then ``check_host_updates()`` (answered by the same round trip)."""
        self.save()
        link = get_link()
        if link is None:
            return
        grow = False
        if _core().rank() == 0:
            grow = upload_state(link, self.snapshot())
        self._agree(grow)

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank when the driver says the job can grow (rank 0 asks, an
        allreduce makes every rank agree). A no-op outside ``run_elastic``."""
        link = get_link()
        if link is None:
            return
        self._agree(link.hosts_updated() if _core().rank() == 0 else False)

    @staticmethod
    def _agree(grow: bool) -> None:
        flag = _core().allreduce(np.array([1 if grow else 0], dtype=np.int32), name="elastic.hosts_updated",
                                 op=ReduceOp.MAX)
        if int(flag[0]):
            raise HostsUpdatedInterrupt(False)

    def sync_from_driver(self) -> bool:
        """Once per process under ``run_elastic``: rank 0 loads the state last committed by an earlier attempt
        (if any) and restores it; every rank learns whether that happened (True: the job was reset)."""
        link = get_link()
        if link is None or self._link_checked:
            return False
        self._link_checked = True
        loaded = False
        if _core().rank() == 0:
            value = download_state(link)
            if value is not None:
                self.load_snapshot(value)
                self.restore()
                loaded = True
        self.was_reset = bool(_core().broadcast_object(loaded, 0, name="elastic.loaded"))
        return self.was_reset

    def save(self) -> None:
        """Snapshot the state in host memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the last snapshot, undoing what changed since."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank's state rank 0's."""
        raise NotImplementedError

    def reset(self) -> None:
        """Called after a reset, before the callbacks (override to rebuild objects that depend on the size)."""

    def snapshot(self) -> Any:
        """The last snapshot as a picklable value."""
        raise NotImplementedError

    def load_snapshot(self, value: Any) -> None:
        """Replace the snapshot by ``value`` (from ``snapshot()``); ``restore()`` then applies it."""
        raise NotImplementedError


class ObjectState(State):
    """State of plain Python objects, given as keywords and exposed as attributes (``state.epoch``).

    ``save()`` deep-copies them (so objects changed in place are snapshotted too); ``sync()`` broadcasts rank 0's.
    """

    def __init__(self, **objects: Any) -> None:
        super().__init__()
        self._saved_state = copy.deepcopy(objects)
        self._set_attrs()

    def save(self) -> None:
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        self.sync_from_driver()
        if self._saved_state:
            self._saved_state = _core().broadcast_object(self._saved_state, 0, name="elastic.objects")
            self._set_attrs()

    def snapshot(self) -> Any:
        return {"objects": self._saved_state}

    def load_snapshot(self, value: Any) -> None:
        self._saved_state = value["objects"]

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))


class ElasticSampler:
    """Partitions a dataset's indices over the ranks and re-partitions what is left after a reset.

    Horovod's ``ElasticSampler``: give it to the state (``TorchState(..., sampler=sampler)``), call
    ``record_batch(batch_idx, batch_size)`` (or ``record_indices``) after each batch and ``set_epoch(epoch)`` at the
    END of an epoch. On commit the ranks' processed indices are united (one allgather), so after a reset the indices
    not yet processed this epoch are shared out again over the new number of ranks. As in Horovod, each rank's share
    is padded (with indices from the start) to the same length; ``get_indices(..., drop_padding=True)`` leaves the
    padding out.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.indices: list[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: forget the processed indices and reshuffle (call it at the end of an epoch)."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Record this rank's batch ``batch_idx`` (of ``batch_size``) as processed."""
        self.record_indices(self.get_indices(batch_idx, batch_size, drop_padding=True))

    def record_indices(self, indices: Iterable[int]) -> None:
        """Record ``indices`` as processed."""
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx: int, batch_size: int, drop_padding: bool = False) -> list[int]:
        """This rank's indices of batch ``batch_idx`` (without the padding if ``drop_padding``)."""
        start = batch_idx * batch_size
        stop = min(start + batch_size, len(self.indices))
        if not drop_padding:
            return self.indices[start:stop]
        real = len(self.remaining_indices)
        return [self.indices[j] for j in range(start, stop) if j * self.num_replicas + self.rank < real]

    def state_dict(self) -> dict[str, Any]:
        """Epoch and processed indices (what a reset keeps)."""
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict()`` and re-partition the remaining indices over the current ranks."""
        self.epoch = int(state_dict["epoch"])
        self.processed_indices = set(state_dict["processed_indices"])
        self.reset()

    def sync_processed(self) -> None:
        """Unite every rank's processed indices (collective; the state does it on commit)."""
        core = _core()
        if core.is_initialized() and core.size() > 1:
            gathered = core.allgather_object(sorted(self.processed_indices), name="elastic.sampler.processed")
            self.processed_indices = set().union(*map(set, gathered))

    def reset(self) -> None:
        """Share the indices not yet processed this epoch out over the current ranks."""
        core = _core()
        initialized = core.is_initialized()
        self.num_replicas = core.size() if initialized else 1
        self.rank = core.rank() if initialized else 0
        remaining = [i for i in range(len(self.dataset)) if i not in self.processed_indices]
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(remaining)
        self.remaining_indices = remaining
        self.num_samples = math.ceil(len(remaining) / self.num_replicas) if remaining else 0
        self.total_size = self.num_samples * self.num_replicas
        padded = remaining + remaining[:self.total_size - len(remaining)]
        self.indices = padded[self.rank:self.total_size:self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


def run_fn(func: Callable[..., Any], reset: Callable[[], None] | None = None) -> Callable[..., Any]:
    """``hvd.elastic.run``: wrap ``func(state, *args, **kwargs)``.

    The wrapper syncs the state first (under ``run_elastic``: from the driver's last commit when the job was reset,
    then running the reset callbacks). A collective failure (``HorovodInternalError``: a peer was lost) restores
    the last commit and is raised on: on Spark the stage fails and the driver relaunches it.
    ``HostsUpdatedInterrupt`` is raised on to the runner, which ends the stage cleanly and relaunches it bigger.
    Outside ``run_elastic`` (``reset`` given), a ``HostsUpdatedInterrupt`` resets in place and runs ``func`` again.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        skip_sync = False
        while True:
            if not skip_sync:
                state.sync()
                if state.was_reset:
                    state.was_reset = False
                    state.on_reset()
            try:
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as exc:
                if get_link() is not None or reset is None:
                    raise
                skip_sync = exc.skip_sync
            except SparkHvdError:
                state.restore()
                raise
            reset()
            state.on_reset()

    return wrapper
