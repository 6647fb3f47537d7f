"""The background engine: one thread per process that negotiates, fuses and runs every collective.

The framework thread calls ``Engine.enqueue(kind, buf, name=...)`` and gets a ``Handle``; the engine thread runs
*rounds*. In a round every rank publishes what was submitted locally since its last round, the ranks gather those
lists (one ``backend.allgather`` of a small message), and every rank runs the same deterministic procedure on the
same gathered data, so all ranks reach the same answer without a coordinator:

- a table of outstanding tensors (name -> which ranks submitted it, with shape/dtype/op) is kept identical on
  every rank; a tensor is *ready* when every rank that has not joined has submitted it;
- ready tensors are answered in one order (first appearance: round, then rank, then submission order), so
  tensors submitted in different orders on different ranks still meet;
- the same name with a different shape, dtype or op on different ranks fails on every rank with a
  ``TensorMismatchError`` naming the tensor and the ranks that disagree;
- ready allreduces of one dtype / op / scale are fused: where the backend reduces many arrays where they lie
  (``backend.fuses_in_place``: the ring's shared memory copies them straight into its staging slots), a round's
  group is one ``allreduce_fused`` collective, since the threshold bounds a fusion buffer and there is none;
  otherwise the engine packs a reusable fusion buffer of up to ``fusion_threshold`` bytes per collective, and
  reduces tensors of 4 MiB and more in place on their own, since copying them would cost more than their
  collective's latency;
- a tensor that some ranks do not submit within ``stall_check_time_s`` is logged with the missing ranks; after
  ``stall_shutdown_time_s`` every rank raises a ``StallError`` naming it, in the same round (each rank reports the
  tensors it finds too old by its own clock in its message, and every rank acts on the union).

Why coordinator-free rather than Horovod's gather-to-rank-0-then-broadcast: one collective per round instead of two
(half the negotiation latency), no rank doing extra work, and it needs nothing from a backend beyond ``allgather``,
so the ring, MPI and torch.distributed backends all run the same engine. The gathered data is
O(size x new requests), small for the sizes this project runs at.

Response cache: the table entries of completed allreduce / broadcast / reducescatter / barrier requests are
remembered (LRU, ``cache_capacity`` entries, identical on every rank because every rank updates it from the same
responses). A request that matches its cached entry is sent as a small integer id instead of its name and metadata,
so a steady training loop exchanges a few bytes per tensor.

Pacing: a round starts ``cycle_time_ms`` after the previous one (or after the first submission following an idle
spell), extended while a burst of submissions is still arriving (up to 5 cycles) so one round carries it. A caller
that waits on a handle whose request is still unsent starts the round at once (``hurry``): nothing submitted
later could join that operation, so the cycle would only add latency.

Fast rounds: a steady training loop sends only cache ids and leaves nothing outstanding. When the table is empty
(which every rank knows, as it is identical everywhere) a round starts with one small SUM allreduce of a vector
with a 1 at each cache id this rank submits, plus a flag for anything else (a new tensor, a join, a shutdown). With
no flag set, the ids whose count is the job size are ready, in id order, without gathering a message; ids that only
some ranks sent, or a flag, lead to the full gather of messages in the same round (``_fast_round``). After two
clean fast rounds that agreed on the same small float group, the next round speculates: one allreduce of
``[flag, tensors...]`` carries negotiation and data together (``_Spec``; at N=2 on shared memory, one larger SUM
tensor is speculated on in place).

Who runs a round: the engine thread, or a caller that waits on a handle (``drive``): it takes the round lock when
the engine thread is not in a round, and runs the round itself, so a blocking ``allreduce`` pays no hand-off
between threads. Both run the same deterministic round, so every rank still makes the same sequence of
collectives, whichever thread runs them; the blocking calls (``start_engine=False``) do not even wake the engine
thread unless they cannot take the lock. A blocking ``allreduce`` of the very tensor a speculation is armed on
(``Engine.allreduce``) goes further: it runs that round's one collective at once, with no request or handle.

Joined ranks (``join()``) take part in the allreduces the others agree on, contributing the identity of the
reduction (zeros for sum/average, so an average still divides by the full size); an allgather, alltoall,
reducescatter or broadcast while a rank has joined fails on the ranks that called it (``TensorMismatchError``, as
Horovod raises), and the ranks stay in step; ``join`` completes for everyone once every rank has joined.

A ``PeerFailureError`` from the backend stops the engine: every pending handle and every later call raises it.
A rank that shuts down tells the others in its last round; their pending and later calls raise ``ShutdownError``
naming it.

Idle behaviour: a round is a collective, but a rank with nothing to do does not spin. With nothing outstanding
anywhere it sleeps until local work arrives, or for a heartbeat round every ``min(1 s, timeout / 4)`` (which keeps
a peer waiting in a round from timing out, e.g. while rank 0 runs validation, and notices dead peers). With work
outstanding on some rank the rounds back off from ``cycle_time_ms`` to 10 ms while no progress is made, and to
100 ms once nothing has moved for a second (a peer in validation, a stalled tensor).

Device tensors (``spark_hvd.core.device.DeviceBuffer``: CUDA tensors, reduced where they lie) are negotiated like
host arrays, with their device kind in the metadata (one name on the GPU on some ranks and in host memory on others
is a ``TensorMismatchError``); their allreduces are fused per device kind and run on a ``DeviceGroup`` (NCCL) that
the engine opens at the first device collective, instead of on the backend. A process set's engine (``scope``)
opens a group of the set's members only, and its errors name global ranks.

Messages are JSON (no unpickling of anything a peer sent); bfloat16 travels as uint16 with ``bfloat16=True``.

Why this module is long (~1200 lines): a round (pacing, fast, speculative and full negotiation, execution of host
and device collectives, stalls) is one state machine whose state must stay identical on every rank, and splitting
it would spread that invariant over several files; what it does not own lives beside it (``handle.py``: handles;
``negotiation.py``: metadata, the table's entries, the response cache; ``device.py``: device tensors and groups).
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from spark_hvd.core.backend import Backend, ReduceOp, alltoall_args
from spark_hvd.core.device import DeviceBuffer, DeviceGroup, GroupScope, open_device_group
from spark_hvd.core.errors import ShutdownError, SparkHvdError, StallError, TensorMismatchError
from spark_hvd.core.handle import GroupHandle, Handle, copy_error, finish_all  # noqa: F401 - GroupHandle re-exported
from spark_hvd.core.negotiation import (
    CACHEABLE,
    KINDS,
    RAGGED,
    Meta,
    ResponseCache,
    TableEntry,
    reduction_identity,
)
from spark_hvd.core.reduce import SUPPORTED_DTYPES, check_dtype, scale_inplace
from spark_hvd.core.settings import Settings
from spark_hvd.core.timeline import Timeline, timeline_path

logger = logging.getLogger(__name__)

_LEN = struct.Struct("!I")
_OP_VALUES = {op: op.value for op in ReduceOp}  # Enum.value is a slow property on the enqueue path
_MAX_BACKOFF_S = 0.010  # round interval while work waits on another rank ...
_LONG_BACKOFF_S = 0.100  # ... and once nothing has moved for _LONG_WAIT_S (a peer in validation, a stall)
_LONG_WAIT_S = 1.0
_BURST_CYCLES = 5
_DIRECT_BYTES = 4 * 1024 * 1024
_SPEC_BYTES = 64 * 1024  # rounds of at most this many bytes are run speculatively (one collective, see _Spec)
_NOT_WITH_JOIN = frozenset({"allgather", "alltoall", "reducescatter", "broadcast"})  # fail while a rank has joined


class _Spec(NamedTuple):
    """A round every rank expects to repeat: the same cache ids, one small float SUM/AVERAGE group.

    Armed (identically on every rank) after two consecutive clean fast rounds that agreed on these ids. The next
    round is then a single allreduce of ``[flag, tensors...]``: every rank whose submissions are exactly ``ids``
    packs its tensors and a flag of 1, any other rank zeros. When the flags add up to the job size, the packed part
    is the answer (negotiation and data in one collective); otherwise every rank drops it, disarms, and negotiates
    the round as usual, having spent one small collective.

    ``in_place``: two ranks on a backend that reduces several arrays where they lie (shared memory), one float
    tensor larger than ``_SPEC_BYTES``, SUM without prescale. Packing it would cost more than the negotiation it
    saves, so the collective is ``allreduce_fused([flag], tensor)`` on the tensor itself; a rank that did not submit
    exactly it contributes -0.0 instead, which leaves every float (-0.0 included) as it is, so on a miss the one rank
    that did keeps its tensor bit for bit (with three or more ranks two could match and mix: not armed there).
    """

    ids: tuple[int, ...]
    dtype: np.dtype
    op: ReduceOp
    prescale: float
    postscale: float
    count: int
    sole: tuple[str, Meta] | None  # (name, metadata) when the round is one tensor: ``Engine.allreduce`` matches it
    staging: np.ndarray  # [flag, tensors...], this speculation's own ([flag] when in_place)
    views: tuple[np.ndarray, ...]  # each tensor's place in ``staging``, in its shape (packing is one copy each)
    in_place: bool


@dataclass
class _Request:
    """One operation submitted on this rank (local state only)."""

    name: str
    meta: Meta
    buf: np.ndarray | None
    op: ReduceOp
    splits: list[int] | None
    handle: Handle
    enqueued: float
    taken: float = 0.0
    sent: bool = False


class Engine:
    """Runs the collectives of one process on its backend from one background thread.

    Args:
        backend: the collectives (ring, MPI, torch.distributed or local).
        settings: fusion threshold, cycle time, cache capacity, timeout, stall check time, timeline.
        scope: a process set's engine: the set and its members' global ranks (its device group is the members'
            own, and its errors name global ranks); None for the whole job.

    ``stats`` counts rounds, collectives and cache use (what tests check fusion with).
    """

    def __init__(self, backend: Backend, settings: Settings, scope: GroupScope | None = None) -> None:
        self.backend = backend
        self.settings = settings
        self.rank = backend.rank
        self.size = backend.size
        self.scope = scope or GroupScope(0, tuple(range(self.size)))
        self.stats: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._sleeping = True  # the engine waits without local work: the next enqueue must wake it
        self._hurried = False  # a caller waits on a handle: send what is submitted now, not after the cycle
        self._outbox: list[_Request] = []
        self._local: dict[str, _Request] = {}
        self._counters: Counter[str] = Counter()
        self._join_handle: Handle | None = None
        self._join_sent = False
        self._shutdown_requested = False
        self._error: BaseException | None = None
        self._stopped = False
        # Rounds run one at a time, in the engine thread or in a caller waiting on a handle (``drive``).
        self._round_lock = threading.Lock()
        self._rounds_done = 0
        self._finished = False  # a round ended the engine (failure, shutdown): no more rounds
        # State identical on every rank.
        self._pending: dict[str, TableEntry] = {}
        self._joined: set[int] = set()
        self._cache = ResponseCache(settings.cache_capacity)
        # Pacing.
        self._cycle = max(settings.cycle_time_ms, 0.0) / 1000.0
        self._backoff_cap = max(self._cycle, _MAX_BACKOFF_S)
        self._heartbeat = 60.0 if self.size == 1 else max(0.05, min(1.0, settings.timeout_s / 4.0))
        self._last_start = 0.0
        self._idle_rounds = 0
        self._progress_at = 0.0
        self._last_enqueue = 0.0
        # A backend that reduces many arrays where they lie (shared memory staging) gets a whole round's
        # tensors of one kind in one collective: the fusion threshold bounds a fusion buffer, and there is none.
        # Otherwise the engine packs a reusable fusion buffer of up to the threshold, and reduces tensors this
        # large in place on their own.
        self._backend_fuses = backend.fuses_in_place
        self._direct_bytes = float("inf") if self._backend_fuses else _DIRECT_BYTES
        self._fusion_buffers: dict[str, np.ndarray] = {}
        self._spec: _Spec | None = None  # identical on every rank
        self._last_common: list[int] = []
        self._unspeculable: list[int] = []  # the cache ids ``_arm`` last found unfit to speculate on
        self.timeline: Timeline | None = None
        if settings.timeline:
            path = timeline_path(settings.timeline, self.rank)
            if path:
                self.timeline = Timeline(path, self.rank)
        self._device_groups: dict[str, DeviceGroup] = {}  # opened by the engine thread at first use
        self._thread = threading.Thread(target=self._run, name=f"spark_hvd-engine-rank{self.rank}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ framework side

    def enqueue(self, kind: str, buf: np.ndarray | None = None, name: str | None = None, *,
                op: ReduceOp = ReduceOp.AVERAGE, prescale: float = 1.0, postscale: float = 1.0,
                bfloat16: bool = False, root: int = 0, splits: Sequence[int] | None = None,
                start_engine: bool = True) -> Handle:
        """Submit one collective; returns at once with a ``Handle``.

        ``start_engine=False`` (the blocking calls, which wait at once) leaves a sleeping engine thread asleep:
        the caller's ``wait()`` runs the round itself, and wakes the engine thread only if it cannot.

        ``allreduce`` and ``broadcast`` work in place on ``buf`` (C-contiguous and writable); the others read
        ``buf`` and return a new array (``alltoall``: ``(array, recv_splits)``). Ops without a name get
        ``"<kind>.noname.<n>"`` from a per-kind counter, the same on every rank that calls in the same order.
        """
        if kind not in KINDS:
            raise ValueError(f"unknown collective {kind!r}; expected one of {KINDS}")
        if op.__class__ is not ReduceOp:
            op = ReduceOp(op)
        if name is None:
            with self._lock:
                name = f"{kind}.noname.{self._counters[kind]}"
                self._counters[kind] += 1
        if kind == "barrier":
            buf = None
            meta = Meta(kind, "", (), "", 0, 1.0, 1.0, False)
        elif isinstance(buf, DeviceBuffer):
            splits = self._check_device_buffer(kind, buf, name, root, splits)
            meta = Meta(kind, buf.dtype.str, buf.shape, _OP_VALUES[op], int(root), float(prescale),
                        float(postscale), buf.bfloat16, buf.device)
        else:
            buf = self._check_buffer(kind, buf, name, bfloat16)
            if kind == "broadcast" and not 0 <= int(root) < self.size:
                raise ValueError(f"broadcast of '{name}': root_rank {root} is not a rank of this job of size "
                                 f"{self.size}")
            if kind == "alltoall":
                try:
                    buf, splits = alltoall_args(buf, splits, self.size)
                except ValueError as exc:
                    raise ValueError(f"alltoall of '{name}': {exc}") from None
            meta = Meta(kind, buf.dtype.str, buf.shape, _OP_VALUES[op], int(root), float(prescale),
                        float(postscale), bool(bfloat16))
        handle = Handle(name, kind, self)
        request = _Request(name, meta, buf, op, list(splits) if splits is not None else None, handle,
                           time.perf_counter())
        with self._lock:
            self._raise_if_unusable()
            if name in self._local:
                raise ValueError(f"a collective named '{name}' is already pending on rank {self.rank}; "
                                 "wait for it before submitting the name again")
            self._local[name] = request
            self._outbox.append(request)
            self._last_enqueue = request.enqueued
            wake = self._sleeping
            if start_engine:
                self._sleeping = False
        if wake and start_engine:  # the engine knows of earlier work: no wake-up (and GIL hand-over) per tensor
            self._wake.set()
        return handle

    def _check_buffer(self, kind: str, buf: Any, name: str, bfloat16: bool) -> np.ndarray:
        if not isinstance(buf, np.ndarray):
            raise TypeError(f"{kind} of '{name}': expected a numpy array, got {type(buf).__name__}")
        if bfloat16 and buf.dtype != np.uint16:
            raise TypeError(f"{kind} of '{name}': bfloat16 data must be passed as a uint16 view, got {buf.dtype}")
        if kind in ("allreduce", "reducescatter"):
            try:
                check_dtype(buf, bfloat16)
            except TypeError as exc:
                raise TypeError(f"{kind} of '{name}': {exc}") from None
        if kind in ("allreduce", "broadcast"):
            if not _in_place_ok(buf.flags):
                raise ValueError(f"{kind} of '{name}' works in place and needs a C-contiguous writable array")
        else:
            buf = np.ascontiguousarray(buf)
            if kind in RAGGED and buf.ndim == 0:
                buf = buf.reshape(1)
        return buf

    def join(self) -> Handle:
        """Declare this rank out of data. Its handle's result is the last rank to join, once all have."""
        with self._lock:
            self._raise_if_unusable()
            if self._join_handle is not None:
                raise ValueError(f"rank {self.rank} has already called join()")
            self._join_handle = Handle("join", "join", self)
            self._join_sent = False
            handle = self._join_handle
        self._wake.set()
        return handle

    def drive(self, handle: Handle) -> None:
        """Run negotiation rounds in the calling thread while ``handle`` waits, instead of handing them over.

        A blocking ``allreduce`` then costs one round and its collective, with no thread hand-off: the caller
        takes the round lock (only when the engine thread is not in a round itself) and runs the same round the
        engine thread would, so every rank still runs the same sequence of collectives whichever thread runs
        them. It goes on while rounds make progress (the peers are submitting too), and leaves the rest to the
        engine thread's pacing once a round moves nothing (a peer is busy elsewhere), so a wait never spins.
        """
        while not handle._done and not self._finished:
            if not self._round_lock.acquire(blocking=False):
                break  # the engine thread is in a round: it will answer, or pace the next one
            try:
                if self._finished:
                    break
                progress = self._guarded_round(in_caller=True)
            finally:
                self._round_lock.release()
            if not progress:
                break
        if not handle._done:
            self.hurry()
            self._wake.set()  # the engine thread may sleep towards a heartbeat: let it pace the new state

    def allreduce(self, buf: np.ndarray, name: str | None = None, *, op: ReduceOp = ReduceOp.AVERAGE,
                  prescale: float = 1.0, postscale: float = 1.0, bfloat16: bool = False) -> np.ndarray:
        """A blocking allreduce of ``buf`` in place (``enqueue(...).wait()``); returns ``buf``.

        The call path of a steady loop: when the engine is armed to speculate on exactly this tensor (the last two
        rounds agreed on it alone: same name, dtype, shape, op and scales) and nothing else is queued on this rank,
        the round that ``enqueue`` and ``wait`` would run is one ``[flag, data]`` collective (``_Spec``), and this
        runs it at once in the calling thread with no request, handle or metadata to build. Otherwise, or when
        the speculation misses (another rank submitted something else), it goes through ``enqueue`` and ``wait``.
        """
        spec = self._spec
        if spec is not None and spec.sole is not None and spec.sole[0] == name and not bfloat16:
            meta = spec.sole[1]
            if (op is spec.op and buf.__class__ is np.ndarray and buf.shape == meta.shape
                    and (buf.dtype is spec.dtype or buf.dtype == spec.dtype)
                    and prescale == meta.prescale and postscale == meta.postscale
                    and _in_place_ok(buf.flags) and self._sole_ready(spec)):
                try:
                    hit = self._guarded_round(True, lambda: self._sole_round(spec, buf, name, meta))
                finally:
                    self._round_lock.release()
                if hit:
                    return buf
        return self.enqueue("allreduce", buf, name, op=op, prescale=prescale, postscale=postscale,
                            bfloat16=bfloat16, start_engine=False).wait()

    def _sole_ready(self, spec: _Spec) -> bool:
        """Take the round lock for ``_sole_round`` if ``spec`` is still armed and nothing else is queued here
        (a join, a shutdown, another request); False (lock not held) otherwise."""
        if self._outbox or self._join_handle is not None or self._shutdown_requested:
            return False
        if not self._round_lock.acquire(blocking=False):
            return False  # the engine thread is in a round
        if self._spec is spec and not self._finished and self._error is None and not self._outbox:
            return True
        self._round_lock.release()
        return False

    def hurry(self) -> None:
        """A caller is about to wait: start the next round now rather than collecting a cycle's worth more.

        Nothing submitted later could join the waited-for operation's round anyway, so waiting out the cycle
        would only add latency (a blocking ``allreduce`` would otherwise pay a whole cycle).
        """
        if self._outbox and not self._hurried:
            self._hurried = True
            self._wake.set()

    def _raise_if_unusable(self) -> None:
        if self._error is not None:
            raise copy_error(self._error)
        if self._shutdown_requested or self._stopped:
            raise ShutdownError(f"the spark_hvd engine of rank {self.rank} has been shut down")

    def check_alive(self, handle: Handle) -> None:
        """Fail ``handle`` if the engine thread is gone without having answered it."""
        if not self._thread.is_alive() and not handle.done():
            error = self._error or ShutdownError(f"the spark_hvd engine of rank {self.rank} stopped before "
                                                 f"'{handle.name}' completed")
            handle._set_error(error)

    @property
    def error(self) -> BaseException | None:
        """The error that stopped the engine (a peer failure), if any."""
        return self._error

    def shutdown(self) -> None:
        """Tell the other ranks, stop the thread (bounded by the timeout) and close the timeline."""
        with self._lock:
            self._shutdown_requested = True
        self._wake.set()
        self._thread.join(self.settings.timeout_s + self._heartbeat + 5.0)
        if self._thread.is_alive():
            logger.warning("the engine thread of rank %d did not stop within the timeout", self.rank)
            self._fail_all(ShutdownError(f"spark_hvd on rank {self.rank} was shut down"))
        if self.timeline is not None:
            self.timeline.close()

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            while not self._finished:
                seen = self._rounds_done
                self._wait_for_round()
                with self._round_lock:
                    if self._finished:
                        break
                    if self._rounds_done != seen:
                        continue  # a waiting caller ran a round meanwhile: pace again from the new state
                    self._guarded_round(in_caller=False)
        finally:
            self._close_device_groups()
            self._stopped = True
            if self.timeline is not None:
                self.timeline.flush()

    def _guarded_round(self, in_caller: bool, body: Callable[[], tuple[bool, bool]] | None = None) -> bool:
        """``_round`` (or ``body``, a round of its own) under the round lock, turning its failure into the engine's
        error. True on progress."""
        try:
            progress, stop = self._round() if body is None else body()
        except SparkHvdError as exc:  # a peer failure, a shut-down backend, settings that differ, a stall
            logger.error("rank %d: %s", self.rank, exc)
            self._fail_all(exc)
            progress, stop = False, True
        except BaseException as exc:  # a bug, or an interrupt of a caller in the middle of a round
            if isinstance(exc, Exception):
                logger.exception("the spark_hvd engine of rank %d failed", self.rank)
            what = "was interrupted in the middle of a round" if in_caller else "failed"
            self._fail_all(SparkHvdError(f"the spark_hvd engine of rank {self.rank} {what}: {exc!r}; the ranks "
                                         "can no longer be kept in step, so spark_hvd stopped"))
            self._rounds_done += 1
            self._stop_engine()
            if in_caller and not isinstance(exc, Exception):
                raise  # KeyboardInterrupt and friends reach the user
            return False
        self._rounds_done += 1
        if stop:
            self._stop_engine()
        return progress

    def _stop_engine(self) -> None:
        self._finished = True
        self._wake.set()

    def _has_local_work(self) -> bool:
        return bool(self._outbox) or self._shutdown_requested or (
            self._join_handle is not None and not self._join_sent)

    def _wait_for_round(self) -> None:
        first_seen: float | None = None
        idle_before = not (self._pending or self._joined)
        while not self._finished:
            self._wake.clear()
            now = time.perf_counter()
            with self._lock:
                local_work = self._has_local_work()
                self._sleeping = not local_work
            if local_work:
                if self._hurried:
                    with self._lock:
                        self._sleeping = False
                    return
                if first_seen is None:
                    first_seen = now
                target = self._last_start + self._cycle
                if idle_before:  # collect a cycle's worth of submissions after idling
                    target = max(target, first_seen + self._cycle)
                if self._cycle > 0 and target <= now:
                    # a burst of submissions still under way (a loop enqueueing gradients): let it finish, so
                    # the ranks negotiate it in one round, for at most _BURST_CYCLES cycles
                    quiet_at = self._last_enqueue + self._cycle / 2
                    if quiet_at > now and now < first_seen + _BURST_CYCLES * self._cycle:
                        target = quiet_at
            elif self._pending or self._joined:
                cap = self._backoff_cap
                if now - self._progress_at > _LONG_WAIT_S:
                    cap = max(cap, min(_LONG_BACKOFF_S, self._heartbeat))
                target = self._last_start + min(cap, self._cycle * (2 ** min(self._idle_rounds, 16)))
            else:
                target = self._last_start + self._heartbeat
            remaining = target - now
            if remaining <= 0:
                with self._lock:
                    self._sleeping = False
                return
            self._wake.wait(remaining)

    def _round(self) -> tuple[bool, bool]:
        """One negotiation round and the collectives it agrees on. Returns (progress, the engine must stop)."""
        start = time.perf_counter()
        self._last_start = start
        with self._lock:
            outgoing, self._outbox = self._outbox, []
            self._hurried = False
            join_flag = self._join_handle is not None and not self._join_sent
            if join_flag:
                self._join_sent = True
            shutdown_flag = self._shutdown_requested
        ids: list[int] = []
        full: list[list] = []
        by_id: dict[int, _Request] = {}
        for request in outgoing:
            request.taken = start
            request.sent = True
            cache_id = self._cache.lookup(request.name, request.meta) if request.meta.kind in CACHEABLE else None
            if cache_id is None:
                full.append(request.meta.to_wire(request.name))
            else:
                ids.append(cache_id)
                by_id[cache_id] = request
        self.stats["cache_hits"] += len(ids)
        self.stats["full_requests"] += len(full)
        first_round = self.stats["rounds"] == 0
        self.stats["rounds"] += 1
        ready: list[tuple[TableEntry, TensorMismatchError | None]] = []
        progress = False
        # The table, the joins and the round count are identical on every rank, so every rank takes the same
        # branch here; the fast round then tells every rank whether another needs the full one.
        if not (first_round or self._pending or self._joined):
            irregular = bool(full) or join_flag or shutdown_flag
            if self._spec is not None:
                exact = not irregular and sorted(ids) == list(self._spec.ids)
                if self._speculative_round(self._spec, by_id if exact else None, start):
                    return True, False
                self._spec = None
            fast = self._fast_round(ids, irregular)
            if fast is not None:
                common, partial = fast
                get = self._cache.get
                ready = [(TableEntry(*get(cache_id)), None) for cache_id in common]
                progress = bool(common) or partial
                if not partial:
                    self._arm(common)
                    self._finish_round(ready, start, progress)
                    return progress, False
                # some ids were sent by only some ranks: they become outstanding entries through the full round
                ids = [cache_id for cache_id in ids if cache_id not in set(common)]
        # a full round may change the cache: re-arm from scratch
        self._spec, self._last_common, self._unspeculable = None, [], []
        fields: list[Any] = [int(join_flag), int(shutdown_flag), ids, full, self._expired_names()]
        if first_round:  # every rank must plan fusion and the cache alike
            fields.append([int(self.settings.fusion_threshold), int(self.settings.cache_capacity)])
        messages = self._gather(fields)
        if first_round:
            self._check_same_settings([m[5] for m in messages])
        new_joins: list[int] = []
        shutdown_ranks: list[int] = []
        expired: set[str] = set()
        for r, (jf, sf, r_ids, r_full, r_expired, *_) in enumerate(messages):
            if sf:
                shutdown_ranks.append(r)
            if jf:
                self._joined.add(r)
                new_joins.append(r)
                progress = True
            for cache_id in r_ids:
                name, meta = self._cache.get(int(cache_id))
                self._add(name, r, meta)
            for item in r_full:
                name, meta = Meta.from_wire(item)
                self._add(name, r, meta)
            expired.update(str(name) for name in r_expired)
            progress = progress or bool(r_ids) or bool(r_full)
        if shutdown_ranks:
            self._stop_for_shutdown(shutdown_ranks)
            return progress, True
        ready += self._ready()
        self._finish_round(ready, start, progress)
        if self._joined and len(self._joined) == self.size:
            self._complete_join(max(new_joins) if new_joins else max(self._joined))
        if expired:
            self._raise_stall(expired)
        return progress or bool(ready), False

    def _fast_round(self, ids: list[int], irregular: bool) -> tuple[list[int], bool] | None:
        """Negotiate response-cache hits with one small allreduce instead of gathering messages.

        Every rank adds a 1 at the position of each cache id it submits (the cache, hence the vector's length,
        is identical on every rank) and a 1 in front when it has anything else to say (a new tensor, a join, a
        shutdown). Returns None when some rank did (then every rank goes on to the full round), else the ids
        every rank submitted, in id order, and whether some ids were submitted by only some ranks.
        """
        vec = np.zeros(1 + self._cache.id_count(), np.int32)
        if irregular:
            vec[0] = 1
        elif ids:
            vec[1 + np.asarray(ids)] = 1
        self.backend.allreduce(vec, ReduceOp.SUM)
        self.stats["fast_rounds"] += 1
        if vec[0]:
            return None
        counts = vec[1:]
        common = np.flatnonzero(counts == self.size).tolist()
        return common, len(common) < np.count_nonzero(counts)

    def _arm(self, common: list[int]) -> None:
        """After a clean fast round: arm speculation when it agreed on the same small float group as the last."""
        previous, self._last_common = self._last_common, common
        self._spec = None
        if not common or common != previous or common == self._unspeculable:
            return
        self._unspeculable = common  # until armed below: a large group is not looked at again every round
        metas = [self._cache.get(cache_id)[1] for cache_id in common]
        first = metas[0]
        dtype = np.dtype(first.dtype)
        key = (first.dtype, first.op, first.prescale, first.postscale, False)
        if dtype.kind != "f" or first.op not in ("sum", "average") or any(
                m.kind != "allreduce" or m.device  # device tensors are never packed into host staging
                or (m.dtype, m.op, m.prescale, m.postscale, m.bfloat16) != key for m in metas):
            return
        count = sum(int(np.prod(m.shape, dtype=np.int64)) for m in metas)
        packed = count * dtype.itemsize <= _SPEC_BYTES
        in_place = (not packed and self.size == 2 and self._backend_fuses and len(common) == 1
                    and first.op == "sum" and first.prescale == 1.0)
        if packed or in_place:
            sole = self._cache.get(common[0]) if len(common) == 1 else None
            staging = np.zeros(1 if in_place else 1 + count, dtype)
            views, offset = [], 1
            for m in metas if packed else ():
                n = int(np.prod(m.shape, dtype=np.int64))
                views.append(staging[offset:offset + n].reshape(m.shape))
                offset += n
            self._spec = _Spec(tuple(common), dtype, ReduceOp(first.op), first.prescale, first.postscale, count,
                               sole, staging, tuple(views), in_place)
            self._unspeculable = []

    def _speculate(self, spec: _Spec, bufs: list[np.ndarray] | None) -> tuple[bool, float, float]:
        """The one collective of a speculative round (see ``_Spec``): allreduce ``[flag, bufs...]`` (zeros when
        ``bufs`` is None: this rank submitted something else; -0.0 in place). On a hit (every rank's flag set) the
        reduced data is in ``bufs``. Returns (hit, start and end of the collective)."""
        staging = spec.staging
        if spec.in_place:
            staging[0] = 0 if bufs is None else 1
            assert spec.sole is not None
            data = np.full(spec.sole[1].shape, -0.0, spec.dtype) if bufs is None else bufs[0]
        elif bufs is None:
            staging.fill(0)
        else:
            staging[0] = 1
            for view, buf in zip(spec.views, bufs, strict=True):
                view[...] = buf
            if spec.prescale != 1.0:
                scale_inplace(staging[1:], spec.prescale)
        t0 = time.perf_counter()
        try:
            if spec.in_place:
                self.backend.allreduce_fused([staging, data], spec.op)
            else:
                self.backend.allreduce(staging, spec.op)
        except SparkHvdError:
            raise
        except Exception as exc:
            raise SparkHvdError(f"allreduce of a speculative round failed on rank {self.rank}: {exc!r}; the ranks "
                                "can no longer be kept in step, so spark_hvd stopped") from exc
        t1 = time.perf_counter()
        self.stats["speculative_rounds"] += 1
        agreed = 1.0 if spec.op is ReduceOp.AVERAGE else float(self.size)
        if not staging[0] > agreed - 0.5 / self.size:  # some rank submitted something else
            self.stats["speculation_misses"] += 1
            return False, t0, t1
        assert bufs is not None  # every rank's flag was 1, this one's included
        if spec.in_place:
            scale_inplace(bufs[0], spec.postscale)
        else:
            if spec.postscale != 1.0:
                scale_inplace(staging[1:], spec.postscale)
            for view, buf in zip(spec.views, bufs, strict=True):
                buf[...] = view
        self.stats["allreduce_collectives"] += 1
        self.stats["allreduce_tensors"] += len(bufs)
        if len(bufs) > 1:
            self.stats["fused_collectives"] += 1
        self._idle_rounds = 0
        self._progress_at = t1
        return True, t0, t1

    def _speculative_round(self, spec: _Spec, mine: dict[int, _Request] | None, start: float) -> bool:
        """A speculative round of submitted requests; True when every rank submitted exactly ``spec.ids`` and the
        tensors are reduced. ``mine``: this rank's requests by id when it did, else None."""
        bufs = None if mine is None else [mine[cache_id].buf for cache_id in spec.ids]
        hit, t0, t1 = self._speculate(spec, bufs)
        if not hit:
            return False
        assert mine is not None
        with self._lock:
            requests = [self._local.pop(mine[cache_id].name) for cache_id in spec.ids]
        for request in requests:
            self._cache.put(request.name, request.meta)
            if self.timeline is not None:
                self.timeline.event(request.name, "ALLREDUCE", t0, t1, fused=len(requests), speculative=True)
        finish_all([(request.handle, request.buf) for request in reversed(requests)])
        if self.timeline is not None:
            self.timeline.event(None, "ROUND", start, time.perf_counter(), tensors=len(requests))
        return True

    def _sole_round(self, spec: _Spec, buf: np.ndarray, name: str, meta: Meta) -> tuple[bool, bool]:
        """``allreduce``'s round: the speculative round of exactly ``buf``, with no request or handle.

        On a miss nothing of this round is left to do here: the other ranks go on to a fast round, which is what
        this rank's next round is too (the speculation is disarmed, the table empty), and ``allreduce`` submits
        ``buf`` to it. Returns (hit, False) as ``_round`` returns (progress, stop)."""
        start = self._last_start = time.perf_counter()
        hit, t0, t1 = self._speculate(spec, [buf])
        if not hit:
            self._spec = None
            return False, False
        self.stats["rounds"] += 1  # a miss is counted by the round that follows it, as in ``_round``
        self.stats["cache_hits"] += 1
        self._cache.put(name, meta)
        if self.timeline is not None:
            self.timeline.event(name, "ALLREDUCE", t0, t1, fused=1, speculative=True)
            self.timeline.event(None, "ROUND", start, time.perf_counter(), tensors=1)
        return True, False

    def _gather(self, fields: list[Any]) -> list[list]:
        payload = json.dumps(fields, separators=(",", ":")).encode()
        message = np.frombuffer(_LEN.pack(len(payload)) + payload, dtype=np.uint8)
        return self._parse(self.backend.allgather(message))

    def _finish_round(self, ready: list[tuple[TableEntry, TensorMismatchError | None]], start: float,
                      progress: bool) -> None:
        if ready:
            progress = True
            self._execute(ready, time.perf_counter())
        self._check_stalls()
        if progress:
            self._idle_rounds = 0
            self._progress_at = time.perf_counter()
        else:
            self._idle_rounds += 1
        if self.timeline is not None and progress:
            self.timeline.event(None, "ROUND", start, time.perf_counter(), tensors=len(ready))

    def _expired_names(self) -> list[str]:
        """Outstanding tensors older than the stall-shutdown time by this rank's clock (at most 5, oldest first).

        Each rank reports its own; every rank acts on the union in the same round, so all raise together.
        """
        limit = self.settings.stall_shutdown_time_s
        if not self._pending or limit <= 0:
            return []
        now = time.monotonic()
        old = sorted((e.created, e.name) for e in self._pending.values() if now - e.created >= limit)
        return [name for _, name in old[:5]]

    def _raise_stall(self, names: set[str]) -> None:
        """Stop the job on every rank with an error naming the stalled tensors and the ranks that lack them."""
        entries = sorted((e for n, e in self._pending.items() if n in names), key=lambda e: (e.created, e.name))
        if not entries:  # they completed in this very round
            return
        now = time.monotonic()

        def missing(entry: TableEntry) -> list[int]:  # as global ranks
            absent = [r for r in range(self.size) if r not in entry.metas and r not in self._joined]
            return self.scope.global_ranks(absent)

        first = entries[0]
        text = (f"stall: tensor '{first.name}'{self._in_set()} was submitted by ranks "
                f"{self.scope.global_ranks(sorted(first.metas))} "
                f"{now - first.created:.0f} s ago but ranks {missing(first)} never submitted it within "
                "SPARK_HVD_STALL_SHUTDOWN_TIME="
                f"{self.settings.stall_shutdown_time_s:g} s, so spark_hvd stopped the job on every rank; one of "
                "them may be stuck or running a different code path")
        if len(entries) > 1:
            text += "; also stalled: " + ", ".join(f"'{e.name}' (missing ranks {missing(e)})" for e in entries[1:])
        raise StallError(text, name=first.name, ranks=missing(first))

    def _check_same_settings(self, configs: list[list[int]]) -> None:
        if all(c == configs[0] for c in configs):
            return
        detail = "; ".join(f"rank {r}: fusion_threshold={c[0]} cache_capacity={c[1]}" for r, c in enumerate(configs))
        raise SparkHvdError("the ranks of this job run with different SPARK_HVD_FUSION_THRESHOLD / "
                            f"SPARK_HVD_CACHE_CAPACITY ({detail}); every rank must use the same values")

    def _parse(self, gathered: np.ndarray) -> list[list]:
        data = gathered.tobytes()
        messages = []
        offset = 0
        for r in range(self.size):
            if offset + _LEN.size > len(data):
                raise SparkHvdError(f"negotiation message of rank {r} is missing (got {len(data)} bytes)")
            (length,) = _LEN.unpack_from(data, offset)
            offset += _LEN.size
            messages.append(json.loads(data[offset:offset + length]))
            offset += length
        return messages

    def _add(self, name: str, rank: int, meta: Meta) -> None:
        entry = self._pending.get(name)
        if entry is None:
            entry = self._pending[name] = TableEntry(name, meta)
        entry.metas[rank] = meta

    def _ready(self) -> list[tuple[TableEntry, TensorMismatchError | None]]:
        active = [r for r in range(self.size) if r not in self._joined]
        size = self.size
        joined = bool(self._joined)
        ready = []
        for entry in list(self._pending.values()):
            if len(entry.metas) == size if not joined else all(r in entry.metas for r in active):
                del self._pending[entry.name]
                ready.append((entry, self._mismatch(entry)))
        return ready

    def _mismatch(self, entry: TableEntry) -> TensorMismatchError | None:
        metas = list(entry.metas.values())
        meta = metas[0]
        same = True
        for m in metas:
            if m != meta:
                same = False
                break
        if same or len({m.agreement_key() for m in metas}) == 1:
            joined = sorted(r for r in self._joined if r not in entry.metas)
            if joined and meta.kind in _NOT_WITH_JOIN:  # Horovod's rule; every rank sees the same table
                return TensorMismatchError(
                    f"{meta.kind} of '{entry.name}' while rank{'s' if len(joined) > 1 else ''} "
                    f"{', '.join(map(str, joined))} ha{'ve' if len(joined) > 1 else 's'} called join(): as in "
                    "Horovod, only allreduce runs while a rank has joined (call it before join(), or after every "
                    "rank has joined)", name=entry.name, ranks=joined)
            return None
        g = self.scope.ranks  # messages and ``ranks`` name global ranks (a process set's engine counts from 0)
        devices = {g[r]: m.device for r, m in entry.metas.items()}
        if len(set(devices.values())) > 1:
            return _device_mismatch(entry.name, devices, self._in_set())
        keys = {g[r]: m.agreement_key() for r, m in entry.metas.items()}
        distinct = set(keys.values())
        counts = Counter(keys.values())
        lowest = min(keys)
        common = max(distinct, key=lambda k: (counts[k], k == keys[lowest]))
        bad = sorted(r for r, k in keys.items() if k != common)
        detail = "; ".join(f"rank {g[r]}: {m.describe()}" for r, m in sorted(entry.metas.items()))
        return TensorMismatchError(
            f"tensor '{entry.name}'{self._in_set()} was submitted differently on different ranks (ranks {bad} differ "
            f"from the others): {detail}. Every rank must submit the same shape, dtype and op under one name.",
            name=entry.name, ranks=bad)

    def _in_set(self) -> str:
        """`` in process set 1 (ranks [1, 2])`` for a process set's engine, else nothing."""
        ps = self.scope.process_set
        return f" in process set {ps} (ranks {list(self.scope.ranks)})" if ps else ""

    def _execute(self, ready: list[tuple[TableEntry, TensorMismatchError | None]], negotiated: float) -> None:
        groups: dict[tuple, list[tuple[TableEntry, _Request | None]]] = {}
        plan: list[tuple[str, Any]] = []
        with self._lock:
            requests = [self._local.pop(e.name) if e.name in self._local and self._local[e.name].sent else None
                        for e, _ in ready]
        for (entry, error), request in zip(ready, requests, strict=True):
            if request is not None and self.timeline is not None:
                self.timeline.event(entry.name, "WAIT_FOR_NEGOTIATION", request.enqueued, request.taken)
                self.timeline.event(entry.name, "NEGOTIATE", request.taken, negotiated)
            if error is not None:
                if request is not None:
                    request.handle._set_error(error)
                continue
            meta = entry.meta
            if meta.kind == "allreduce" and meta.device:  # fused per device kind, on the device group
                key = ("device", meta.device, meta.dtype, meta.op, meta.prescale, meta.postscale, meta.bfloat16)
                if key not in groups:
                    groups[key] = []
                    plan.append(("device_allreduce", key))
                groups[key].append((entry, request))
            elif meta.kind == "allreduce":
                key = (meta.dtype, meta.op, meta.prescale, meta.postscale, meta.bfloat16)
                if key not in groups:
                    groups[key] = []
                    plan.append(("allreduce", key))
                groups[key].append((entry, request))
            else:
                plan.append(("one", (entry, request)))
        for what, item in plan:
            if what == "allreduce":
                self._run_allreduces(item, groups[item])
            elif what == "device_allreduce":
                self._run_device_allreduces(item, groups[item])
            else:
                self._run_one(*item)

    def _run_allreduces(self, key: tuple, items: list[tuple[TableEntry, _Request | None]]) -> None:
        dtype = np.dtype(key[0])
        limit = float("inf") if self._backend_fuses else max(int(self.settings.fusion_threshold), 0)
        chunk: list[tuple[TableEntry, _Request | None, np.ndarray]] = []
        chunk_bytes = 0
        for entry, request in items:
            meta = entry.meta
            if request is not None:
                buf = request.buf
            else:
                buf = reduction_identity(meta.shape, dtype, meta.op, meta.bfloat16)
            nbytes = buf.nbytes
            self._cache.put(entry.name, meta)
            if nbytes >= self._direct_bytes:
                # packing a large tensor would cost more copying than its own collective's latency
                self._allreduce_chunk(key, [(entry, request, buf)])
                continue
            if chunk and chunk_bytes + nbytes > limit:
                self._allreduce_chunk(key, chunk)
                chunk, chunk_bytes = [], 0
            chunk.append((entry, request, buf))
            chunk_bytes += nbytes
        if chunk:
            self._allreduce_chunk(key, chunk)

    def _allreduce_chunk(self, key: tuple, chunk: list[tuple[TableEntry, _Request | None, np.ndarray]]) -> None:
        dtype_str, op_value, prescale, postscale, bfloat16 = key
        op = ReduceOp(op_value)
        bufs = [buf for _, _, buf in chunk]
        tl = self.timeline
        self.stats["allreduce_collectives"] += 1
        self.stats["allreduce_tensors"] += len(chunk)
        if len(chunk) > 1:
            self.stats["fused_collectives"] += 1
        try:
            if len(bufs) == 1 or self._backend_fuses:
                if prescale != 1.0:
                    for buf in bufs:
                        scale_inplace(buf, prescale, bfloat16)
                t0 = time.perf_counter()
                if len(bufs) == 1:
                    self.backend.allreduce(bufs[0], op, bfloat16=bfloat16)
                else:
                    self.backend.allreduce_fused(bufs, op, bfloat16=bfloat16)
                t1 = time.perf_counter()
                if postscale != 1.0:
                    for buf in bufs:
                        scale_inplace(buf, postscale, bfloat16)
                if tl is not None:
                    for entry, _, _ in chunk:
                        tl.event(entry.name, "ALLREDUCE", t0, t1, fused=len(bufs))
            else:
                total = sum(b.size for b in bufs)
                fusion = self._fusion_buffer(np.dtype(dtype_str), total)
                t0 = time.perf_counter()
                offset = 0
                for buf in bufs:
                    fusion[offset:offset + buf.size] = buf.reshape(-1)
                    offset += buf.size
                scale_inplace(fusion, prescale, bfloat16)
                t1 = time.perf_counter()
                self.backend.allreduce(fusion, op, bfloat16=bfloat16)
                t2 = time.perf_counter()
                scale_inplace(fusion, postscale, bfloat16)
                offset = 0
                for buf in bufs:
                    buf.reshape(-1)[...] = fusion[offset:offset + buf.size]
                    offset += buf.size
                t3 = time.perf_counter()
                if tl is not None:
                    for entry, _, _ in chunk:
                        tl.event(entry.name, "MEMCPY_IN_FUSION_BUFFER", t0, t1)
                        tl.event(entry.name, "ALLREDUCE", t1, t2, fused=len(bufs))
                        tl.event(entry.name, "MEMCPY_OUT_FUSION_BUFFER", t2, t3)
        except SparkHvdError:  # a peer failure, a closed backend: as it is
            raise
        except Exception as exc:
            names = [e.name for e, _, _ in chunk]
            raise SparkHvdError(f"allreduce of {names[:5]}{'...' if len(names) > 5 else ''} failed on rank "
                                f"{self.rank}: {exc!r}; the ranks can no longer be kept in step, so spark_hvd "
                                "stopped") from exc
        # last first: a caller synchronizing in submission order then wakes once per group, not per tensor
        finish_all([(request.handle, buf) for _, request, buf in reversed(chunk) if request is not None])

    def _fusion_buffer(self, dtype: np.dtype, count: int) -> np.ndarray:
        buf = self._fusion_buffers.get(dtype.str)
        if buf is None or buf.size < count:
            buf = self._fusion_buffers[dtype.str] = np.empty(count, dtype)
        return buf[:count]

    def _run_one(self, entry: TableEntry, request: _Request | None) -> None:
        meta = entry.meta if request is None else request.meta
        if meta.device:
            self._run_device_one(entry, request)
            return
        kind = meta.kind
        op = ReduceOp(meta.op) if meta.op else ReduceOp.SUM
        self.stats[f"{kind}_collectives"] += 1
        if kind in CACHEABLE:  # before anything can fail: the caches of all ranks must stay identical
            self._cache.put(entry.name, entry.meta)
        t0 = time.perf_counter()
        try:
            if kind == "barrier":  # the one collective here a joined rank (``request`` None) takes part in
                self.backend.barrier()
                result: Any = None
            elif request is None:  # pragma: no cover - ``_mismatch`` fails these while a rank has joined
                raise SparkHvdError(f"{kind} of '{entry.name}' reached rank {self.rank}, which has joined")
            elif kind == "broadcast":
                self.backend.broadcast(request.buf, meta.root)
                result = request.buf
            elif kind == "allgather":
                result = self.backend.allgather(request.buf)
            elif kind == "alltoall":
                out, recv_splits = self.backend.alltoall(request.buf, request.splits)
                result = (out, list(recv_splits))
            elif kind == "reducescatter":
                buf = request.buf.copy() if meta.prescale != 1.0 else request.buf
                scale_inplace(buf, meta.prescale, meta.bfloat16)
                result = self.backend.reducescatter(buf, op, bfloat16=meta.bfloat16)
                scale_inplace(result, meta.postscale, meta.bfloat16)
            else:  # pragma: no cover - enqueue rejects unknown kinds
                raise SparkHvdError(f"unknown collective {kind!r}")
        except SparkHvdError:  # a peer failure, a closed backend: as it is
            raise
        except Exception as exc:
            raise SparkHvdError(f"{kind} of '{entry.name}' failed on rank {self.rank}: {exc!r}; the ranks can no "
                                "longer be kept in step, so spark_hvd stopped") from exc
        if self.timeline is not None and request is not None:
            self.timeline.event(entry.name, kind.upper(), t0, time.perf_counter())
        if request is not None:
            request.handle._set_result(result)

    def _complete_join(self, last: int) -> None:
        self._joined.clear()
        with self._lock:
            handle, self._join_handle = self._join_handle, None
            self._join_sent = False
        if handle is not None:
            handle._set_result(last)

    def _check_stalls(self) -> None:
        limit = self.settings.stall_check_time_s
        if not self._pending or limit <= 0:
            return
        now = time.monotonic()
        for entry in self._pending.values():
            if now - entry.created >= limit and now - entry.warned >= limit:
                entry.warned = now
                if self.rank not in entry.metas:
                    continue
                missing = [r for r in range(self.size) if r not in entry.metas and r not in self._joined]
                logger.warning(
                    "stall: tensor '%s' was submitted by ranks %s %.0f s ago but ranks %s have not submitted it; "
                    "one of them may be stuck or running a different code path",
                    entry.name, sorted(entry.metas), now - entry.created, missing)

    def _stop_for_shutdown(self, ranks: list[int]) -> None:
        others = self.scope.global_ranks([r for r in ranks if r != self.rank])
        if others:
            error = ShutdownError(f"rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} shut down "
                                  f"spark_hvd{self._in_set()} while rank {self.scope.ranks[self.rank]} "
                                  "still had operations pending")
            self._error = error
        else:
            error = ShutdownError(f"spark_hvd on rank {self.rank} was shut down")
        self._fail_all(error, set_error=False)

    def _fail_all(self, error: BaseException, set_error: bool = True) -> None:
        with self._lock:
            if set_error and self._error is None:
                self._error = error
            requests = list(self._local.values())
            self._local.clear()
            self._outbox.clear()
            join, self._join_handle = self._join_handle, None
        for request in requests:
            request.handle._set_error(error)
        if join is not None:
            join._set_error(error)

    # ------------------------------------------------------------------ device tensors (spark_hvd.core.device)
    # CUDA tensors (DeviceBuffer) are negotiated like host arrays; only where they are reduced differs: on a
    # DeviceGroup (NCCL; gloo stands in on CPU), opened at the first device collective every rank submitted.

    def device_groups(self) -> dict[str, DeviceGroup]:
        """The device groups this engine has opened so far, by device kind (none until its first device
        collective; for tests and diagnostics)."""
        return dict(self._device_groups)

    def _check_device_buffer(self, kind: str, buf: DeviceBuffer, name: str, root: int,
                             splits: Sequence[int] | None) -> list[int] | None:
        if kind in ("allreduce", "reducescatter") and buf.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{kind} of '{name}': cannot reduce tensors of dtype {buf.dtype}")
        if kind == "broadcast" and not 0 <= int(root) < self.size:
            raise ValueError(f"broadcast of '{name}': root_rank {root} is not a rank of this job of size {self.size}")
        if kind in RAGGED and not buf.shape:
            raise ValueError(f"{kind} of '{name}' needs a tensor with at least one dimension")
        if kind == "alltoall":
            try:  # the splits rules of host arrays, checked on an empty stand-in of the same rows
                return alltoall_args(np.empty((buf.shape[0], 0)), splits, self.size)[1]
            except ValueError as exc:
                raise ValueError(f"alltoall of '{name}': {exc}") from None
        return None

    def _device_group(self, device: str) -> DeviceGroup:
        group = self._device_groups.get(device)
        if group is None:
            try:
                group = open_device_group(device, self.backend, self.settings, self.scope)
            except SparkHvdError:
                raise
            except Exception as exc:
                raise SparkHvdError(f"{self.scope.label(self.rank)} could not set up the collectives on {device} "
                                    f"tensors: {exc!r}") from exc
            self._device_groups[device] = group
        return group

    def _run_device_allreduces(self, key: tuple, items: list[tuple[TableEntry, _Request | None]]) -> None:
        _, device, dtype_str, op_value, prescale, postscale, bfloat16 = key
        group = self._device_group(device)
        limit = max(int(self.settings.fusion_threshold), 1)
        dtype = np.dtype(dtype_str)
        chunks: list[list[tuple[TableEntry, _Request | None, DeviceBuffer]]] = [[]]
        chunk_bytes = 0
        for entry, request in items:
            meta = entry.meta
            buf = request.buf if request is not None else group.placeholder(meta.shape, dtype, bfloat16, meta.op)
            self._cache.put(entry.name, meta)
            if chunks[-1] and chunk_bytes + buf.nbytes > limit:
                chunks.append([])
                chunk_bytes = 0
            chunks[-1].append((entry, request, buf))
            chunk_bytes += buf.nbytes
        for chunk in chunks:
            names = [e.name for e, _, _ in chunk]
            self.stats["allreduce_collectives"] += 1
            self.stats["device_collectives"] += 1
            self.stats["allreduce_tensors"] += len(chunk)
            if len(chunk) > 1:
                self.stats["fused_collectives"] += 1
            t0 = time.perf_counter()
            try:
                group.allreduce([b for _, _, b in chunk], ReduceOp(op_value), prescale, postscale)
            except SparkHvdError:
                raise
            except Exception as exc:
                raise SparkHvdError(f"allreduce of {names[:5]}{'...' if len(names) > 5 else ''} on {device} failed on "
                                    f"{self.scope.label(self.rank)}: {exc!r}; the ranks can no longer be kept in step, "
                                    "so spark_hvd stopped") from exc
            if self.timeline is not None:
                for name in names:
                    self.timeline.event(name, "ALLREDUCE", t0, time.perf_counter(), fused=len(chunk))
            finish_all([(r.handle, b.tensor) for _, r, b in reversed(chunk) if r is not None])

    def _run_device_one(self, entry: TableEntry, request: _Request | None) -> None:
        meta = entry.meta if request is None else request.meta
        kind = meta.kind
        group = self._device_group(meta.device)
        self.stats[f"{kind}_collectives"] += 1
        self.stats["device_collectives"] += 1
        if kind in CACHEABLE:
            self._cache.put(entry.name, entry.meta)
        if request is None:  # pragma: no cover - ``_mismatch`` fails these while a rank has joined
            raise SparkHvdError(f"{kind} of '{entry.name}' reached rank {self.rank}, which has joined")
        buf = request.buf
        t0 = time.perf_counter()
        try:
            if kind == "broadcast":
                group.broadcast(buf, meta.root)
                result: Any = buf.tensor
            elif kind == "allgather":
                result = group.allgather(buf)
            elif kind == "alltoall":
                out, recv = group.alltoall(buf, request.splits)
                result = (out, list(recv))
            elif kind == "reducescatter":
                result = group.reducescatter(buf, ReduceOp(meta.op), meta.prescale, meta.postscale)
            else:
                raise SparkHvdError(f"{kind} is not a collective on device tensors")
        except SparkHvdError:
            raise
        except Exception as exc:
            raise SparkHvdError(f"{kind} of '{entry.name}' on {meta.device} failed on {self.scope.label(self.rank)}: "
                                f"{exc!r}; the ranks can no longer be kept in step, so spark_hvd stopped") from exc
        if self.timeline is not None:
            self.timeline.event(entry.name, kind.upper(), t0, time.perf_counter())
        request.handle._set_result(result)

    def _close_device_groups(self) -> None:
        groups, self._device_groups = list(self._device_groups.values()), {}
        for group in groups:
            try:
                group.close()
            except Exception:  # a communicator whose peers are gone cannot always be torn down cleanly
                logger.debug("rank %d: closing a device group failed", self.rank, exc_info=True)


def _in_place_ok(flags: Any) -> bool:
    """An array an allreduce may work on in place (``np.ndarray.flags``): C-contiguous and writable."""
    return bool(flags.c_contiguous and flags.writeable)


def _device_mismatch(name: str, devices: dict[int, str], in_set: str = "") -> TensorMismatchError:
    where = {r: d or "host memory" for r, d in devices.items()}
    by_place: dict[str, list[int]] = {}
    for r, place in sorted(where.items()):
        by_place.setdefault(place, []).append(r)
    detail = "; ".join(f"on {place} on ranks {ranks}" for place, ranks in by_place.items())
    majority = max(by_place.values(), key=len)
    return TensorMismatchError(
        f"tensor '{name}'{in_set} is {detail}: a collective's tensors must be on the GPU on every rank or in host "
        "memory on every rank (move them with .cuda() / .cpu(), or set SPARK_HVD_DEVICE_BACKEND=none to reduce CUDA "
        "tensors through host memory)", name=name, ranks=sorted(r for r in where if r not in majority))
