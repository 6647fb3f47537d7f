"""The background engine: one thread per process that negotiates every collective; the executor runs them.

Why this file is over 600 lines (~680): it is one idea, the loop and its rounds (fast, speculative, fresh and full
negotiation), a state machine whose state must stay identical on every rank. Beside it: the pacing, the blocking
calls' shortcuts, the checks of a submission, the table, and the executor that runs every collective.

The framework thread calls ``Engine.enqueue(kind, buf, name=...)`` and gets a ``Handle``; the engine thread runs
*rounds*, paced by ``spark_hvd.core.engine.pacing``. In a round every rank publishes what was submitted locally since
its last round, and every rank runs the same deterministic procedure on the same gathered data, so all ranks reach
the same answer without a coordinator: one collective per round instead of Horovod's gather to rank 0 and
broadcast, no rank doing extra work, and nothing needed from a backend beyond allreduce and allgather, so the ring,
MPI and torch.distributed backends run the same engine.

The engine decides, the executor does (``spark_hvd.core.engine.executor``). The negotiation table
(``spark_hvd.core.engine.table``, thread-free) keeps the outstanding tensors identical on every rank and says which
are ready (every rank that has not joined submitted it), in one order, which mismatch (a ``TensorMismatchError``
naming the tensor and the ranks) and which stall (``StallError`` after ``stall_shutdown_time_s``, on every rank in
the same round). The response cache (``spark_hvd.core.engine.negotiation``: LRU, identical on every rank) lets a
request that matches its cached entry travel as a small integer id. Every collective of every round, the
negotiation's own exchanges and the shortcuts below included, runs on the executor's groups (the host backend, or a
device group for CUDA tensors), and the executor alone counts collectives, puts entries in the response cache and
records timeline events.

Every rank takes the same kind of round, since the choice follows from state identical everywhere:

- *fast*: with the table empty, one small SUM allreduce of a vector with a 1 at each cache id this rank submits,
  a flag for anything else, each rank's message length and digest (``table.fast_vector``). Ids every rank sent are
  ready with no message; otherwise the full round's messages follow in one more allreduce, or none travels when
  every rank's message is the same (each rank's own is every rank's);
- *full*: the first round, or tensors outstanding: the messages are gathered and absorbed by the table;
- *speculative*: once the ranks have seen which clean round follows the last one (``speculation.Predictor``), the
  next one is one allreduce of ``[flag, tensors...]`` (``speculation.Spec``: in place on shared memory at N=2, the
  flag in band over TCP, ``spark_hvd.core.algorithms.agreed``), or, for a round too large to pack (a training
  step's gradients), the flag alone and then the tensors fused where they lie; a miss costs one small collective;
- *fresh*: after two rounds of new names of one layout, or a round that names the engine made up are expected to
  follow (``_advance``: an unnamed call after each barrier), the next is one allreduce of ``[flag, name digests,
  tensors...]`` (``spark_hvd.core.engine.fresh``).

Who runs a round: the engine thread, or a caller that waits on a handle (``drive``), which takes the round lock
when the engine thread is not in a round and runs the same round, so a blocking call pays no hand-off between
threads; a blocking ``allreduce`` or ``barrier`` whose round is the one expected runs it at once
(``spark_hvd.core.engine.blocking``).

Joined ranks (``join()``) take part in the allreduces and barriers the others agree on with the identity of the
reduction (an average still divides by the full size); an allgather, alltoall, reducescatter or broadcast while a
rank has joined fails on the ranks that called it. A ``PeerFailureError`` stops the engine: every pending handle
and later call raises it. A rank that shuts down tells the others in its last round; their pending and later calls
raise ``ShutdownError`` naming it. Messages are JSON (nothing a peer sent is unpickled).

Autotune (``settings.autotune``): rank 0's ``autotune.Tuner`` scores settings from what the rounds reduce; its
choice rides in a fast round's vector and every rank switches at that round, before its collectives (``_switch``;
the backend's own thresholds through ``Backend.tunables`` / ``apply_tuning``). While a choice waits, rank 0 lets an
armed speculation miss, so that a fast round comes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from spark_hvd.core.backend import Backend, ReduceOp
from spark_hvd.core.engine import checks
from spark_hvd.core.engine.autotune import Point, Tuner, allreduced, job_tuner
from spark_hvd.core.engine.blocking import BlockingCalls
from spark_hvd.core.engine.device import DeviceGroup, GroupScope
from spark_hvd.core.engine.executor import Executor, Request
from spark_hvd.core.engine.fresh import FreshSpec, Layout, build_fresh, fresh_layout
from spark_hvd.core.engine.handle import GroupHandle, Handle, copy_error, finish_all  # noqa: F401 - GroupHandle re-exported
from spark_hvd.core.engine.negotiation import (
    CACHEABLE,
    KINDS,
    MADE_UP_ALLREDUCE,
    ResponseCache,
    TableEntry,
    made_up,
    noname,
)
from spark_hvd.core.engine.pacing import Pacer
from spark_hvd.core.engine.speculation import Predictor, Spec
from spark_hvd.core.engine.table import (
    NegotiationTable,
    Ready,
    check_same_settings,
    decode_messages,
    encode_message,
    fast_answer,
    fast_vector,
    message_digest,
    message_lengths,
    place_message,
    same_messages,
    tune_slots,
)
from spark_hvd.core.engine.timeline import Timeline, timeline_path
from spark_hvd.core.errors import ShutdownError, SparkHvdError
from spark_hvd.core.jobenv import JobEnv
from spark_hvd.core.settings import Settings

logger = logging.getLogger(__name__)



class Engine(BlockingCalls):
    """Runs the collectives of one process on its backend from one background thread.

    Args:
        backend: the collectives (ring, MPI, torch.distributed or local).
        settings: fusion threshold, cycle time, cache capacity, timeout, stall check time, timeline.
        scope: a process set's engine: the set and its members' global ranks (its device group is the members'
            own, and its errors name global ranks); None for the whole job.

    ``stats`` counts rounds, collectives and cache use (what tests check fusion with). ``autotune_history``: the
    settings autotune switched to, as ``(fast round, fusion threshold, cycle time ms, halving-doubling bytes)``,
    the same on every rank. ``job``: the launch contract ``init()`` read (the autotune log's job and attempt).
    """

    def __init__(self, backend: Backend, settings: Settings, scope: GroupScope | None = None,
                 job: JobEnv | None = None) -> None:
        self.backend = backend
        self.settings = settings
        self.rank = backend.rank
        self.size = backend.size
        self.scope = scope or GroupScope(0, tuple(range(self.size)), job)
        self._stats: Counter[str] = Counter()
        # speculative rounds of one tensor carried in band (``BlockingCalls._in_band_round``): counted here, folded
        # into ``stats`` when it is read (a Counter's update costs a steady loop's call more than the rest of it)
        self._in_band_hits = 0
        self._in_band_barriers = 0
        self._in_band_folded = (0, 0)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._sleeping = True  # the engine waits without local work: the next enqueue must wake it
        self._hurried = False  # a caller waits on a handle: send what is submitted now, not after the cycle
        self._outbox: list[Request] = []
        self._local: dict[str, Request] = {}
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
        self._table = NegotiationTable(self.size, self.scope, settings.stall_check_time_s,
                                       settings.stall_shutdown_time_s)
        self._cache = ResponseCache(settings.cache_capacity)
        self._pacer = Pacer(settings.cycle_time_ms, self.size, settings.timeout_s)
        self._last_enqueue = 0.0
        # a speculation may run in place; not among 3+ ranks over TCP, where its flag alone costs a log-depth exchange
        self._backend_fuses = backend.fuses_in_place and getattr(backend, "tcp_ring_size", 0) < 3
        self._spec: Spec | None = None  # identical on every rank
        self._predictor = Predictor(self._cache.get, self.size, self._backend_fuses, backend.agrees_in_band,
                                    lambda: self._cache.version, backend.agrees_small)
        self._fresh: FreshSpec | None = None  # a round of new names expected (``spark_hvd.core.engine.fresh``)
        self._fresh_last: Layout | None = None  # the layout of the last round of new names every rank agreed on
        self._new_layout: Layout | None = None  # ... of the last round of names the engine made up (``_advance``)
        self._fresh_specs: dict[Layout, FreshSpec] = {}
        self._timeline: Timeline | None = None
        if settings.timeline:
            path = timeline_path(settings.timeline, self.rank)
            if path:
                self.timeline = Timeline(path, self.rank)
        self._executor = Executor(backend, settings, self.scope, self._cache, self._stats, self.timeline)
        self._host = self._executor.host  # the negotiation's own exchanges
        self.autotune_history: list[tuple[int, int, float, int]] = []
        self._tuner: Tuner | None = None  # rank 0 of the job's own engine, with autotune on
        if settings.autotune and self.rank == 0 and not self.scope.process_set:
            self._tuner = job_tuner(settings, backend.tunables(), job)
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
        if name is None and kind == "barrier":
            name = "barrier"  # one at a time per rank (it blocks): one name, so the response cache knows it
        elif name is None:
            with self._lock:
                name = noname(kind, self._counters[kind])
                self._counters[kind] += 1
        buf, meta, splits = checks.request(kind, buf, name, op, root, prescale, postscale, bfloat16, splits,
                                           self.size)
        handle = Handle(name, kind, self)
        request = Request(name, meta, buf, op, list(splits) if splits is not None else None, handle,
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
    def timeline(self) -> Timeline | None:
        """Where the engine records its activities (``start_timeline`` may replace it while the engine runs)."""
        return self._timeline

    @timeline.setter
    def timeline(self, value: Timeline | None) -> None:
        self._timeline = value
        if hasattr(self, "_executor"):
            self._executor.timeline = value

    @property
    def error(self) -> BaseException | None:
        """The error that stopped the engine (a peer failure), if any."""
        return self._error

    def shutdown(self) -> None:
        """Tell the other ranks, stop the thread (bounded by the timeout) and close the timeline."""
        with self._lock:
            self._shutdown_requested = True
        self._wake.set()
        self._thread.join(self.settings.timeout_s + self._pacer.heartbeat + 5.0)
        if self._thread.is_alive():
            logger.warning("the engine thread of rank %d did not stop within the timeout", self.rank)
            self._fail_all(ShutdownError(f"spark_hvd on rank {self.rank} was shut down"))
        if self.timeline is not None:
            self.timeline.close()
        if self._tuner is not None:
            self._tuner.close()

    # ------------------------------------------------------------------ autotune (spark_hvd.core.engine.autotune)

    def _switch(self, point: Point) -> None:
        """Every rank, in the same fast round: run with ``point``'s fusion threshold, cycle time and halving-doubling
        threshold from now on (the last is the ring backend's own setting, read by each of its TCP allreduces)."""
        self.settings = replace(self.settings, fusion_threshold=point.fusion_threshold,
                                cycle_time_ms=point.cycle_time_ms, halving_doubling_bytes=point.halving_doubling_bytes)
        self._executor.settings = self.settings
        self._pacer.set_cycle(point.cycle_time_ms)
        if "halving_doubling_bytes" in self.backend.tunables():  # the round's collectives come after this
            self.backend.apply_tuning({"halving_doubling_bytes": point.halving_doubling_bytes})
        self.autotune_history.append((self._stats["fast_rounds"], point.fusion_threshold, point.cycle_time_ms,
                                      point.halving_doubling_bytes))
        self._stats["autotune_switches"] += 1
        if self._tuner is not None:
            self._tuner.applied(point, time.perf_counter())

    def _tuning(self) -> bool:
        """Rank 0's tuner still measures (once it is done there is nothing to observe: it only sends its result)."""
        return self._tuner is not None and not self._tuner.done

    def _observe(self, names: list[str], nbytes: int) -> None:
        """Tell rank 0's tuner what a round allreduced."""
        assert self._tuner is not None
        if names:
            self._tuner.observe(names, nbytes, time.perf_counter())

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
            self._executor.close()
            self._stopped = True
            if self.timeline is not None:
                self.timeline.flush()

    @property
    def stats(self) -> Counter[str]:
        """Rounds, collectives and cache use so far, by name (what tests check fusion with)."""
        counts = (self._in_band_hits, self._in_band_barriers)
        if counts != self._in_band_folded:
            with self._lock:
                (hits, barriers), self._in_band_folded = self._in_band_folded, counts
                hits, barriers = counts[0] - hits, counts[1] - barriers
                stats = self._stats
                for key in ("rounds", "cache_hits", "speculative_rounds"):
                    stats[key] += hits + barriers
                stats["allreduce_collectives"] += hits
                stats["allreduce_tensors"] += hits
                stats["barrier_collectives"] += barriers
        return self._stats

    def _guarded_round(self, in_caller: bool, body: Callable[..., tuple[bool, bool]] | None = None,
                       *args: Any) -> bool:
        """``_round`` (or ``body(*args)``, a round of its own) under the round lock, turning its failure into the
        engine's error. True on progress."""
        try:
            progress, stop = self._round() if body is None else body(*args)
        except BaseException as exc:
            self._round_failed(exc, in_caller)
            return False
        self._rounds_done += 1
        if stop:
            self._stop_engine()
        return progress

    def _round_failed(self, exc: BaseException, in_caller: bool) -> None:
        """A round (under the round lock) raised ``exc``: the engine's error for every waiter, and the engine stops.
        Re-raises a caller's interrupt (KeyboardInterrupt and friends reach the user)."""
        if isinstance(exc, SparkHvdError):  # a peer failure, a shut-down backend, settings that differ, a stall
            logger.error("rank %d: %s", self.rank, exc)
            self._fail_all(exc)
        else:  # a bug, or an interrupt of a caller in the middle of a round
            if isinstance(exc, Exception):
                logger.exception("the spark_hvd engine of rank %d failed", self.rank)
            what = "was interrupted in the middle of a round" if in_caller else "failed"
            self._fail_all(SparkHvdError(f"the spark_hvd engine of rank {self.rank} {what}: {exc!r}; the ranks "
                                         "can no longer be kept in step, so spark_hvd stopped"))
        self._rounds_done += 1
        self._stop_engine()
        if in_caller and not isinstance(exc, Exception):
            raise exc

    def _stop_engine(self) -> None:
        self._finished = True
        self._wake.set()

    def _has_local_work(self) -> bool:
        return bool(self._outbox) or self._shutdown_requested or (
            self._join_handle is not None and not self._join_sent)

    def _wait_for_round(self) -> None:
        first_seen: float | None = None
        idle_before = self._table.idle
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
            target = self._pacer.next_round(now, first_seen if local_work else None, idle_before,
                                            self._last_enqueue, self._table.idle)
            remaining = target - now
            if remaining <= 0:
                with self._lock:
                    self._sleeping = False
                return
            self._wake.wait(remaining)

    def _round(self) -> tuple[bool, bool]:
        """One negotiation round and the collectives it agrees on. Returns (progress, the engine must stop)."""
        start = self._pacer.last_start = time.perf_counter()
        with self._lock:
            outgoing, self._outbox = self._outbox, []
            self._hurried = False
            join_flag = self._join_handle is not None and not self._join_sent
            if join_flag:
                self._join_sent = True
            shutdown_flag = self._shutdown_requested
        ids: list[int] = []
        full: list[list] = []
        fresh: list[Request] = []  # the requests ``full`` describes, in the same order
        by_id: dict[int, Request] = {}
        for request in outgoing:
            request.taken = start
            request.sent = True
            cache_id = self._cache.lookup(request.name, request.meta) if request.meta.kind in CACHEABLE else None
            if cache_id is None:
                full.append(request.meta.to_wire(request.name))
                fresh.append(request)
            else:
                ids.append(cache_id)
                by_id[cache_id] = request
        self._stats["cache_hits"] += len(ids)
        self._stats["full_requests"] += len(full)
        first_round = self._stats["rounds"] == 0
        self._stats["rounds"] += 1
        ready: Ready = []
        progress = False
        messages: list[list] | None = None
        # The table, the joins and the round count are identical on every rank, so every rank takes the same
        # branch here; the fast round then tells every rank whether another needs the full one.
        if not (first_round or not self._table.idle):
            irregular = bool(full) or join_flag or shutdown_flag
            choice = self._tuner.pending if self._tuner is not None else None
            steer = choice is not None  # rank 0's autotune choice must ride on a fast round: speculations miss
            if self._spec is not None:
                exact = not (irregular or steer) and sorted(ids) == list(self._spec.ids)
                if self._speculative_round(self._spec, by_id if exact else None, start):
                    return True, False
                self._spec = None
            if self._fresh is not None:
                layout = self._fresh.layout
                same = not (ids or join_flag or shutdown_flag or steer) and len(fresh) == len(layout) and all(
                    request.meta == meta for request, meta in zip(fresh, layout, strict=False))
                if self._fresh_round(self._fresh, fresh if same else None, start):
                    return True, False
            # the message this rank would send in a full round (the table is empty: nothing has expired); its
            # length rides on the fast round, so a full round that follows moves every message in one allreduce
            message = encode_message([int(join_flag), int(shutdown_flag), ids, full, []])
            vec = fast_vector(ids, irregular, self._cache.id_count(), self.rank, self.size, message.size,
                              message_digest(message) if irregular else (0, 0),
                              choice.encode() if choice is not None else (0, 0))
            self._host.allreduce_staged(vec, ReduceOp.SUM)
            self._stats["fast_rounds"] += 1
            switch = Point.decode(tune_slots(vec, self.size))
            if switch is not None:  # rank 0's autotune choice: every rank switches here, before this round's work
                self._switch(switch)
            fast = fast_answer(vec, self.size)
            common: list[int] = []
            if fast is not None:
                common, partial = fast
                get = self._cache.get
                ready = [(TableEntry(*get(cache_id)), None) for cache_id in common]
                progress = bool(common) or partial
                if not partial:
                    self._advance(common)
                    if common:
                        self._fresh_last = None
                    self._finish_round(ready, start, progress)
                    return progress, False
            if same_messages(vec, self.size):  # every rank sent this very message (the same new tensors)
                self._stats["messages_skipped"] += 1
                if not (join_flag or shutdown_flag):
                    # what the table would make of ``size`` copies of it: every tensor ready, all agreed, in the
                    # message's order (its cache ids, then its new tensors)
                    get = self._cache.get
                    ready = [(TableEntry(*get(cache_id)), None) for cache_id in ids]
                    ready += [(TableEntry(request.name, request.meta), None) for request in fresh]
                    # the new tensors break the context; what was learnt stays (their ids are new: no id changed
                    # its meaning, or the cache's version moved and the predictor forgets all at its next round).
                    # Names the engine made up never come back: such a round is learnt as ``Predictor.NEW``, so
                    # that a loop of unnamed calls between barriers speculates on its barriers and does not guess
                    # the round after a barrier wrongly (``followed_by_new``)
                    self._spec = None
                    layout = None if ids else fresh_layout([request.meta for request in fresh])
                    if any(made_up(entry.name, entry.meta.kind) for entry, _ in ready):
                        self._spec = self._predictor.followed_by_new()
                        self._new_layout = layout
                    else:
                        self._predictor.forget_last()
                    # twice in a row new tensors of one layout: expect a third (``spark_hvd.core.engine.fresh``)
                    if layout is not None and layout == self._fresh_last:
                        self._fresh = self._fresh_spec(layout)
                    self._fresh_last = layout
                    self._finish_round(ready, start, True)
                    self._sighted(ready)
                    return True, False
                messages = decode_messages(message, 1) * self.size
            else:
                buf = place_message(message, message_lengths(vec, self.size), self.rank)
                self._host.allreduce_staged(buf, ReduceOp.SUM)
                messages = decode_messages(buf, self.size)
            if common:  # some ids were sent by only some ranks: only those become outstanding entries
                done = set(common)
                for m in messages:
                    m[2] = [cache_id for cache_id in m[2] if cache_id not in done]
        # a full round: the rounds before it are no context for the one after it (if it changes the cache's ids,
        # the predictor forgets everything it learnt at its next round)
        self._spec = None
        self._predictor.forget_last()
        self._fresh = self._fresh_last = None
        table = self._table
        if messages is None:  # the first round, or outstanding tensors: gather the messages
            fields: list[Any] = [int(join_flag), int(shutdown_flag), ids, full, table.expired()]
            if first_round:  # every rank must plan fusion and the cache alike
                fields.append([int(self.settings.fusion_threshold), int(self.settings.cache_capacity)])
            messages = decode_messages(self._host.allgather(encode_message(fields)), self.size)
            if first_round:
                check_same_settings([m[5] for m in messages])
        news = table.absorb(messages, self._cache)
        progress = progress or news.progress
        if news.shutdown:
            self._stop_for_shutdown(news.shutdown)
            return progress, True
        ready += table.ready()
        self._finish_round(ready, start, progress)
        self._sighted(ready)
        if table.all_joined():
            self._complete_join(max(news.joins) if news.joins else max(table.joined))
        if news.expired:
            error = table.stall_error(news.expired)
            if error is not None:
                raise error
        return progress or bool(ready), False

    def _sighted(self, ready: Ready) -> None:
        """A full round that left nothing outstanding is a clean sighting of what it reduced: the predictor may
        expect those tensors again at the next round (a loop's second call), unless a round of new names is
        expected (``spark_hvd.core.engine.fresh``) or the round reduced a name the engine made up (``noname``: it
        never comes back, so expecting it would cost a missed speculation at the next round). Everything read here
        is identical on every rank."""
        if not ready or self._fresh is not None or not self._table.idle:
            return
        ids = set()
        for entry, mismatch in ready:
            if made_up(entry.name, entry.meta.kind):
                return
            cache_id = self._cache.lookup(entry.name, entry.meta) if entry.meta.kind in CACHEABLE else None
            if mismatch is not None or cache_id is None:
                return
            ids.add(cache_id)
        self._spec = self._predictor.advance(sorted(ids))

    def _speculative_round(self, spec: Spec, mine: dict[int, Request] | None, start: float) -> bool:
        """A speculative round of submitted requests (``Executor.speculate``); True when every rank submitted
        exactly ``spec.ids`` and the tensors are reduced. ``mine``: this rank's requests by id when it did."""
        bufs = None if mine is None else [] if spec.barrier else [mine[cache_id].buf for cache_id in spec.ids]
        hit, _, t1 = self._executor.speculate(spec, bufs)
        if not hit:
            return False
        assert mine is not None
        with self._lock:
            requests = [self._local.pop(mine[cache_id].name) for cache_id in spec.ids]
        self._advance(spec.ids)
        self._fresh_last = None
        if self._tuning() and not spec.barrier:
            self._observe([request.name for request in requests], sum(request.buf.nbytes for request in requests))
        finish_all([(request.handle, request.buf) for request in reversed(requests)])
        self._executor.round_done(start, len(requests))
        self._pacer.progressed(t1)
        return True

    def _advance(self, ids: list[int] | tuple[int, ...]) -> None:
        """A clean round agreed on ``ids``: the predictor learns it and arms the next speculation. When what it
        expects next is a round of names the engine made up (``Predictor.expects_new``: an unnamed ``allreduce(t)``
        after each ``barrier()``), the round of new names of the last such round's layout is armed instead
        (``spark_hvd.core.engine.fresh``): that call is then one collective, not a fast round and the data. A wrong
        layout costs one small collective and disarms it until the next round of made-up names."""
        self._spec = spec = self._predictor.advance(ids)
        if spec is None and self._fresh is None and self._new_layout is not None and self._predictor.expects_new():
            self._fresh = self._fresh_spec(self._new_layout)

    def _fresh_hit(self, names: Sequence[str] | None) -> None:
        """A round of new names was agreed in one collective: when the engine made them up, the predictor learns
        it as ``NEW`` (what follows it, a barrier, is speculated on), as when the round was negotiated."""
        if names and names[0].startswith(MADE_UP_ALLREDUCE) and all(made_up(name, "allreduce") for name in names):
            self._spec = self._predictor.followed_by_new()

    def _fresh_spec(self, layout: Layout) -> FreshSpec:
        spec = self._fresh_specs.get(layout)
        if spec is None:
            if len(self._fresh_specs) >= 64:
                self._fresh_specs.clear()
            spec = self._fresh_specs[layout] = build_fresh(layout, self.size)
        return spec

    def _fresh_round(self, spec: FreshSpec, mine: list[Request] | None, start: float) -> bool:
        """A round of new names as one collective (``Executor.fresh``); True when every rank submitted
        ``spec.layout`` under the same names and the tensors are reduced. ``mine``: this rank's requests when they
        have the layout, else None. On a miss the speculation is disarmed and nothing of the requests changed."""
        names = None if mine is None else [request.name for request in mine]
        hit, t1 = self._executor.fresh(spec, names, None if mine is None else [request.buf for request in mine])
        if not hit:
            self._fresh = self._new_layout = None
            return False
        assert mine is not None
        self._fresh_hit(names)
        with self._lock:
            for request in mine:
                self._local.pop(request.name)
        if self._tuning():
            self._observe([request.name for request in mine], sum(request.buf.nbytes for request in mine))
        self._executor.round_done(start, len(mine))
        finish_all([(request.handle, request.buf) for request in reversed(mine)])
        self._pacer.progressed(t1)
        return True

    def _finish_round(self, ready: Ready, start: float, progress: bool) -> None:
        if ready:
            progress = True
            with self._lock:
                requests = [self._local.pop(e.name) if e.name in self._local and self._local[e.name].sent else None
                            for e, _ in ready]
            self._executor.execute(ready, requests, time.perf_counter())
            if self._tuning():
                self._observe(*allreduced(ready))
        for warning in self._table.stall_warnings(self.rank):
            logger.warning("%s", warning)
        if progress:
            self._pacer.progressed(time.perf_counter())
            self._executor.round_done(start, len(ready))
        else:
            self._pacer.idle()

    def _complete_join(self, last: int) -> None:
        self._table.clear_joins()
        with self._lock:
            handle, self._join_handle = self._join_handle, None
            self._join_sent = False
        if handle is not None:
            handle._set_result(last)

    def _stop_for_shutdown(self, ranks: list[int]) -> None:
        others = self.scope.global_ranks([r for r in ranks if r != self.rank])
        if others:
            error = ShutdownError(f"rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} shut down "
                                  f"spark_hvd{self._table.in_set()} while rank {self.scope.ranks[self.rank]} "
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

    # ------------------------------------------------------------------ device tensors (spark_hvd.core.engine.device)

    def device_groups(self) -> dict[str, DeviceGroup]:
        """The device groups this engine has opened so far, by device kind (none until its first device
        collective; for tests and diagnostics)."""
        return self._executor.device_groups()
