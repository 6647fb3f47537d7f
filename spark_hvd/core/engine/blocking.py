"""The blocking calls' shortcuts: a round run at once in the calling thread, as one collective.

``Engine.allreduce`` and ``Engine.barrier`` are ``enqueue(...).wait()``, except when the engine expects exactly
the round they would start: a speculation armed on this very tensor (``spark_hvd.core.engine.speculation``: same
name, dtype, shape, op and scales) or on a round of this rank's barrier alone, or a round of one new name of this
layout (``spark_hvd.core.engine.fresh``). With nothing else queued here, the call then takes the round lock and runs
that round's one collective through the executor (``Executor.speculate`` / ``Executor.fresh``) with no request,
handle or metadata to build. On a miss (another rank submitted something else) the other ranks go on to a fast
round, which is this rank's next round too (the speculation is disarmed, the table empty), and the call goes
through ``enqueue`` and ``wait``. A mixin of ``Engine``: the state it reads is the engine's.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.engine.checks import BARRIER_META, in_place_ok
from spark_hvd.core.engine.fresh import FreshSpec, Layout
from spark_hvd.core.engine.negotiation import MADE_UP_ALLREDUCE, ResponseCache, noname
from spark_hvd.core.engine.speculation import Predictor, Spec
from spark_hvd.core.errors import SparkHvdError
from spark_hvd.core.reduce import scale_inplace

if TYPE_CHECKING:
    from spark_hvd.core.engine.autotune import Tuner
    from spark_hvd.core.engine.executor import Executor, Request
    from spark_hvd.core.engine.handle import Handle
    from spark_hvd.core.engine.pacing import Pacer
    from spark_hvd.core.engine.timeline import Timeline


class BlockingCalls:
    """``Engine.allreduce`` and ``Engine.barrier`` (see the module docstring)."""

    # the engine's state these read (``spark_hvd.core.engine.engine.Engine`` sets it)
    _stats: Counter[str]
    _in_band_hits: int
    _in_band_barriers: int
    _rounds_done: int
    _lock: threading.Lock
    _round_lock: threading.Lock
    _counters: Counter[str]
    _local: dict[str, Request]
    _outbox: list[Request]
    _join_handle: Handle | None
    _shutdown_requested: bool
    _finished: bool
    _error: BaseException | None
    _cache: ResponseCache
    _spec: Spec | None
    _fresh: FreshSpec | None
    _fresh_last: Layout | None
    _new_layout: Layout | None
    _predictor: Predictor
    _tuner: Tuner | None
    _pacer: Pacer
    _executor: Executor
    _timeline: Timeline | None
    _guarded_round: Callable[..., bool]
    _round_failed: Callable[[BaseException, bool], None]
    _advance: Callable[[list[int] | tuple[int, ...]], None]
    _fresh_hit: Callable[[list[str] | None], None]
    _tuning: Callable[[], bool]
    _observe: Callable[[list[str], int], None]
    enqueue: Callable[..., Handle]

    def allreduce(self, buf: np.ndarray, name: str | None = None, *, op: ReduceOp = ReduceOp.AVERAGE,
                  prescale: float = 1.0, postscale: float = 1.0, bfloat16: bool = False) -> np.ndarray:
        """A blocking allreduce of ``buf`` in place (``enqueue(...).wait()``); returns ``buf``.

        The call path of a steady loop: when the engine is armed to speculate on exactly this tensor (the predictor
        expects a round of it alone next: same name, dtype, shape, op and scales) and nothing else is queued on this
        rank, the round that ``enqueue`` and ``wait`` would run is one ``[flag, data]`` collective (``Spec``), and this
        runs it at once in the calling thread with no request, handle or metadata to build. The same for a new
        name when a round of one new tensor of this layout is expected (``spark_hvd.core.engine.fresh``). Otherwise, or
        when the speculation misses (another rank submitted something else), it goes through ``enqueue`` and
        ``wait``.
        """
        fresh = self._fresh
        if (fresh is not None and fresh.sole is not None and self._spec is None and buf.__class__ is np.ndarray
                and not bfloat16):  # (an armed ``Spec`` comes first: its round is the one every rank runs first)
            meta = fresh.layout[0]
            if (op, buf.shape, buf.dtype, prescale, postscale) == fresh.sole and in_place_ok(buf.flags):
                if name is None:
                    with self._lock:
                        name = noname("allreduce", self._counters["allreduce"])
                        self._counters["allreduce"] += 1
                if (name not in self._local and self._cache.lookup(name, meta) is None
                        and self._sole_ready(fresh)):
                    try:
                        hit = self._guarded_round(True, self._fresh_sole_round, fresh, buf, name)
                    finally:
                        self._round_lock.release()
                    if hit:
                        return buf
        spec = self._spec
        if spec is not None and spec.sole is not None and spec.sole[0] == name and not bfloat16:
            meta = spec.sole[1]
            if (op is spec.op and buf.__class__ is np.ndarray and buf.shape == meta.shape
                    and (buf.dtype is spec.dtype or buf.dtype == spec.dtype)
                    and prescale == meta.prescale and postscale == meta.postscale
                    and in_place_ok(buf.flags) and self._sole_ready(spec) and self._armed_round(spec, buf, name)):
                return buf
        return self.enqueue("allreduce", buf, name, op=op, prescale=prescale, postscale=postscale,
                            bfloat16=bfloat16, start_engine=False).wait()

    def barrier(self) -> None:
        """A blocking barrier (``enqueue("barrier").wait()``).

        When the engine is armed to speculate on a round of this rank's barrier alone (an allreduce between
        barriers, as osu_allreduce loops), that round is the flag's one collective, and this runs it at once in the
        calling thread with no request or handle, as ``allreduce`` does for its tensor; otherwise, or on a miss, it
        goes through ``enqueue`` and ``wait``.
        """
        spec = self._spec
        if spec is not None and spec.barrier and len(spec.ids) == 1:
            cached = self._cache.lookup("barrier", BARRIER_META)
            if (cached == spec.ids[0] and "barrier" not in self._local and self._sole_ready(spec)
                    and self._armed_round(spec, None, "barrier")):
                return
        self.enqueue("barrier", start_engine=False).wait()

    def _sole_ready(self, spec: Spec | FreshSpec) -> bool:
        """Take the round lock for ``_sole_round`` (``_fresh_sole_round``) if ``spec`` is still armed and nothing
        else is queued here (a join, a shutdown, another request); False (lock not held) otherwise."""
        if self._outbox or self._join_handle is not None or self._shutdown_requested:
            return False
        if self._tuner is not None and self._tuner.pending is not None:
            return False  # rank 0's autotune choice must ride on a fast round: this round must not be speculative
        if not self._round_lock.acquire(blocking=False):
            return False  # the engine thread is in a round
        armed = self._spec is spec or self._fresh is spec
        if armed and not self._finished and self._error is None and not self._outbox:
            return True
        self._round_lock.release()
        return False

    def _armed_round(self, spec: Spec, buf: np.ndarray | None, name: str) -> bool:
        """The round of the armed speculation ``spec`` on ``buf`` alone (None: the barrier), the round lock held (by
        ``_sole_ready``) and released here: in one step when its flag rides in band and nothing watches the round,
        else ``_sole_round``. True on a hit."""
        if spec.in_band and self._timeline is None and self._tuner is None:
            return self._in_band_round(spec, buf)
        try:
            return self._guarded_round(True, self._sole_round, spec, buf, name)
        finally:
            self._round_lock.release()

    def _in_band_round(self, spec: Spec, buf: np.ndarray | None) -> bool:
        """``allreduce``'s round when the speculation carries its flag in the tensor's own collective
        (``Spec.in_band``) and nothing watches the round (no timeline, no autotune): ``_sole_round`` and
        ``Executor.speculate`` in one step, the steady small loop's path (``buf`` None: ``barrier``'s round, the
        flag alone). Called with the round lock held (by ``_sole_ready``); releases it. True on a hit (``buf``
        reduced); on a miss ``buf`` is as it was and the speculation disarmed, as in ``_sole_round``."""
        executor = self._executor
        try:
            try:
                now = self._pacer.last_start = time.perf_counter()
                hit = executor.host.allreduce_agreed(spec.staging if buf is None else buf, spec.op, True)
            except SparkHvdError:
                raise
            except Exception as exc:
                raise executor.speculation_failed(exc) from exc
            self._rounds_done += 1
            if not hit:
                self._spec = None
                stats = self._stats  # (a miss is counted by the round that follows it, as in ``_round``)
                stats["speculative_rounds"] += 1
                stats["speculation_misses"] += 1
                return False
            # rounds, cache hits, speculative rounds, collectives (and tensors): folded in by ``Engine.stats``
            if buf is None:
                self._in_band_barriers += 1
            else:
                self._in_band_hits += 1
                if spec.postscale != 1.0:
                    scale_inplace(buf, spec.postscale)
            cache, predictor = self._cache, self._predictor
            if predictor.steady is not spec.ids or predictor.seen_version != cache.version:
                name, meta = spec.entries[0]
                cache.put(name, meta)
                self._advance(spec.ids)
            # (else a steady loop's round: the predictor would arm ``spec`` again, and no other round since the
            # last, which put this name in the cache, moved it from the cache's most recent place)
            self._fresh_last = None
            pacer = self._pacer
            pacer.idle_rounds = 0  # ``Pacer.progressed``, inline
            pacer.progress_at = now
            if buf is None:  # the flag's collective was the barrier: leave it with the other ranks, last
                executor.host.leave_together()
            return True
        except BaseException as exc:
            self._round_failed(exc, True)
            return False
        finally:
            self._round_lock.release()

    def _sole_round(self, spec: Spec, buf: np.ndarray | None, name: str) -> tuple[bool, bool]:
        """``allreduce``'s round: the speculative round of exactly ``buf``, with no request or handle (``buf``
        None: ``barrier``'s round of this rank's barrier alone).

        On a miss nothing of this round is left to do here: the other ranks go on to a fast round, which is what
        this rank's next round is too (the speculation is disarmed, the table empty), and ``allreduce`` submits
        ``buf`` to it. Returns (hit, False) as ``_round`` returns (progress, stop)."""
        pacer = self._pacer
        start = pacer.last_start = time.perf_counter()
        hit, _, t1 = self._executor.speculate(spec, [] if buf is None else [buf])
        if not hit:
            self._spec = None
            return False, False
        stats = self._stats
        stats["rounds"] += 1  # a miss is counted by the round that follows it, as in ``_round``
        stats["cache_hits"] += 1
        self._advance(spec.ids)
        self._fresh_last = None
        if self._tuner is not None and self._tuning() and buf is not None:
            self._observe([name], buf.nbytes)
        if self._timeline is not None:
            self._executor.round_done(start, 1)
        pacer.idle_rounds = 0  # ``Pacer.progressed``, inline on the steady loop's path
        pacer.progress_at = t1
        return True, False

    def _fresh_sole_round(self, spec: FreshSpec, buf: np.ndarray, name: str) -> tuple[bool, bool]:
        """``allreduce``'s round of one new name: the round of ``spec`` with ``buf`` alone, with no request or
        handle. On a miss the other ranks go on to a fast round, which is what this rank's next round is too (the
        speculation is disarmed), and ``allreduce`` submits ``buf`` to it. Returns (hit, False)."""
        pacer = self._pacer
        start = pacer.last_start = time.perf_counter()
        if not self._executor.fresh_one(spec, name, buf):
            self._fresh = self._new_layout = None
            return False, False
        if name.startswith(MADE_UP_ALLREDUCE):  # the engine made it up: ``Engine._fresh_hit``
            self._fresh_hit([name])
        stats = self._stats
        stats["rounds"] += 1  # a miss is counted by the round that follows it, as in ``_round``
        stats["full_requests"] += 1
        if self._tuning():
            self._observe([name], buf.nbytes)
        if self._timeline is not None:
            self._executor.round_done(start, 1)
        pacer.idle_rounds = 0  # ``Pacer.progressed``, inline on this path
        pacer.progress_at = start
        return True, False
