"""Runs what a negotiation round agreed on: fusion, then each collective on its group (host or device).

The engine hands ``Executor.execute`` the ready table entries of a round (identical and in one order on every
rank) with this rank's requests for them; every rank therefore makes the same collectives in the same order:

- ready allreduces of one place (host memory or a device kind), dtype, op and scaling are fused: up to
  ``fusion_threshold`` bytes per collective, or all of them in one where the group reduces many arrays where they
  lie (``Group.fuses_in_place``: the ring's shared memory); host tensors of ``Group.direct_bytes`` and more are
  reduced on their own, since packing them costs more than their collective's latency;
- the other kinds run one by one;
- a rank that has joined (no request) takes part in the allreduces and barriers with the identity of the
  reduction (``Group.placeholder``);
- a ready entry with a mismatch fails its handle; the rank makes no collective for it (nor does any other).

Host arrays run on a ``HostGroup`` over the job's backend, device tensors on a ``DeviceGroup`` (NCCL; gloo stands
in on CPU) that the executor opens at the first device collective every rank reached: both behind one ``Group``
interface, so host and device share this one path (Horovod's ``OperationManager``).

The engine's shortcuts run here too, on the host group: a speculative round's one collective (``speculate``:
``spark_hvd.core.engine.speculation``) and a round of new names in one collective (``fresh``:
``spark_hvd.core.engine.fresh``); so do the negotiation's own exchanges (``host``). Every collective count, response
cache put and timeline event of a round is made in this module, whichever way the round went.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from spark_hvd.core.backend import Backend, ReduceOp
from spark_hvd.core.engine.device import DeviceGroup, GroupScope, check_device_backend
from spark_hvd.core.engine.fresh import FreshSpec, agreed, pack, pack_one, unpack
from spark_hvd.core.engine.group import Group, HostGroup
from spark_hvd.core.engine.handle import Handle, finish_all
from spark_hvd.core.engine.negotiation import CACHEABLE, Meta, ResponseCache, TableEntry
from spark_hvd.core.engine.speculation import Spec
from spark_hvd.core.engine.timeline import Timeline
from spark_hvd.core.errors import SparkHvdError, TensorMismatchError
from spark_hvd.core.reduce import scale_inplace
from spark_hvd.core.settings import Settings

logger = logging.getLogger(__name__)


@dataclass
class Request:
    """One operation submitted on this rank (local state only)."""

    name: str
    meta: Meta
    buf: Any  # np.ndarray, a DeviceBuffer, or None (barrier)
    op: ReduceOp
    splits: list[int] | None
    handle: Handle
    enqueued: float
    taken: float = 0.0
    sent: bool = False


Item = tuple[TableEntry, Request | None]


class Executor:
    """Runs a round's agreed collectives on the host backend or a device group.

    Args:
        backend: the job's (or process set's) host collectives.
        settings: the fusion threshold, and what a device group is set up with.
        scope: whose device groups to open, and which global ranks errors name.
        cache: the response cache, updated here as every rank's is (before anything can fail).
        stats: the engine's counters (collectives, tensors, fusion).
        timeline: where activities are recorded, or None.
    """

    def __init__(self, backend: Backend, settings: Settings, scope: GroupScope, cache: ResponseCache,
                 stats: Counter[str], timeline: Timeline | None) -> None:
        self.backend = backend
        self.settings = settings
        self.scope = scope
        self.cache = cache
        self.stats = stats
        self.timeline = timeline
        self.rank = backend.rank
        self.size = backend.size
        self.host = HostGroup(backend)
        self._staged = self.host.allreduce_staged
        self._device_groups: dict[str, DeviceGroup] = {}  # opened by the engine thread at first use

    def execute(self, ready: Sequence[tuple[TableEntry, TensorMismatchError | None]],
                requests: Sequence[Request | None], negotiated: float) -> None:
        """Run the round's ready entries (``requests[i]``: this rank's for ``ready[i]``, None when it has
        joined); ``negotiated``: when the round's negotiation ended (for the timeline)."""
        groups: dict[tuple, list[Item]] = {}
        plan: list[tuple[bool, Any]] = []  # (fused allreduce group?, its key or the one item)
        tl = self.timeline
        for (entry, error), request in zip(ready, requests, strict=True):
            if request is not None and tl is not None:
                tl.event(entry.name, "WAIT_FOR_NEGOTIATION", request.enqueued, request.taken)
                tl.event(entry.name, "NEGOTIATE", request.taken, negotiated)
            if error is not None:
                if request is not None:
                    request.handle._set_error(error)
                continue
            meta = entry.meta
            if meta.kind == "allreduce":
                key = (meta.device, meta.dtype, meta.op, meta.prescale, meta.postscale, meta.bfloat16)
                if key not in groups:
                    groups[key] = []
                    plan.append((True, key))
                groups[key].append((entry, request))
            else:
                plan.append((False, (entry, request)))
        for fused, item in plan:
            if fused:
                self._allreduces(item, groups[item])
            else:
                self._one(*item)

    def group(self, device: str) -> Group:
        """The host group (``device`` ""), or the device kind's group, opened here at first use (collective)."""
        if not device:
            return self.host
        group = self._device_groups.get(device)
        if group is None:
            try:
                group = _open_device_group(device, self.backend, self.settings, self.scope)
            except SparkHvdError:
                raise
            except Exception as exc:
                raise SparkHvdError(f"{self.scope.label(self.rank)} could not set up the collectives on {device} "
                                    f"tensors: {exc!r}") from exc
            self._device_groups[device] = group
        return group

    def device_groups(self) -> dict[str, DeviceGroup]:
        """The device groups opened so far, by device kind."""
        return dict(self._device_groups)

    def close(self) -> None:
        """Close the device groups (the engine thread, as it ends)."""
        groups, self._device_groups = list(self._device_groups.values()), {}
        for group in groups:
            try:
                group.close()
            except Exception:  # a communicator whose peers are gone cannot always be torn down cleanly
                logger.debug("rank %d: closing a device group failed", self.rank, exc_info=True)

    def round_done(self, start: float, tensors: int) -> None:
        """A round that moved something ended (its ``ROUND`` on the timeline, from ``start``)."""
        if self.timeline is not None:
            self.timeline.event(None, "ROUND", start, time.perf_counter(), tensors=tensors)

    # ------------------------------------------------------------------ speculative rounds: one collective each

    def speculate(self, spec: Spec, bufs: list[np.ndarray] | None) -> tuple[bool, float, float]:
        """The one collective of a speculative round (``Spec``): ``[flag, bufs...]`` staged, beside the tensor
        (``in_place``: -0.0 where this rank submitted something else), the flag as the tensor's own first frame
        (``in_band``), or the flag alone and then the tensors fused where they lie (``ahead``); ``bufs`` None: this
        rank submitted something else. On a hit (every rank submitted ``spec.ids``) ``bufs`` hold the result and
        the round's tensors are counted, put in the response cache and on the timeline. Returns (hit, the
        collective's start and end)."""
        staging = spec.staging
        if spec.ahead:  # the flag's own collective, then the tensors' where they lie (every rank's flag was 1)
            staging[0] = 0 if bufs is None else 1
            t0 = time.perf_counter()
            try:
                self._staged(staging, ReduceOp.SUM)
                hit = staging[0] > self.size - 0.5
                if hit:
                    assert bufs is not None
                    self.host.allreduce(bufs, spec.op, spec.prescale, spec.postscale)
            except SparkHvdError:
                raise
            except Exception as exc:
                raise self.speculation_failed(exc) from exc
            t1 = time.perf_counter()
        elif spec.in_band:  # the flag travels ahead of the tensor in its own collective (``allreduce_agreed``)
            if spec.barrier:
                data = spec.staging  # (empty: the flag alone)
            else:
                data = np.broadcast_to(np.zeros(1, spec.dtype), (spec.count,)) if bufs is None else bufs[0]
            t0 = time.perf_counter()
            try:
                hit = self.host.allreduce_agreed(data, spec.op, bufs is not None)
            except SparkHvdError:
                raise
            except Exception as exc:
                raise self.speculation_failed(exc) from exc
            t1 = time.perf_counter()
        else:
            beside = None
            if spec.in_place:
                staging[0] = 0 if bufs is None else 1
                assert spec.sole is not None
                beside = np.full(spec.sole[1].shape, -0.0, spec.dtype) if bufs is None else bufs[0]
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
                self._staged(staging, spec.op, beside)
            except SparkHvdError:
                raise
            except Exception as exc:
                raise self.speculation_failed(exc) from exc
            t1 = time.perf_counter()
            size = self.size
            hit = staging[0] > (1.0 if spec.op is ReduceOp.AVERAGE else float(size)) - 0.5 / size
        stats = self.stats
        stats["speculative_rounds"] += 1
        if not hit:  # some rank submitted something else: no rank's tensor changed
            stats["speculation_misses"] += 1
            return False, t0, t1
        assert bufs is not None  # every rank's flag was 1, this one's included
        if spec.barrier:  # the flag's collective was the barrier: leave it with the other ranks
            self.host.leave_together()
        elif spec.in_place or spec.in_band:
            scale_inplace(bufs[0], spec.postscale)
        elif not spec.ahead:  # (the fused collective scaled its tensors itself)
            if spec.postscale != 1.0:
                scale_inplace(staging[1:], spec.postscale)
            for view, buf in zip(spec.views, bufs, strict=True):
                buf[...] = view
        if spec.barrier:
            stats["barrier_collectives"] += 1
            activity = "BARRIER"
        else:
            stats["allreduce_collectives"] += 1
            stats["allreduce_tensors"] += len(bufs)
            if len(bufs) > 1:
                stats["fused_collectives"] += 1
            activity = "ALLREDUCE"
        cache, tl = self.cache, self.timeline
        for name, meta in spec.entries:  # every rank submitted exactly these
            cache.put(name, meta)
            if tl is not None:
                tl.event(name, activity, t0, t1, fused=len(spec.entries), speculative=True)
        return True, t0, t1

    def fresh(self, spec: FreshSpec, names: Sequence[str] | None,
              bufs: Sequence[np.ndarray] | None) -> tuple[bool, float]:
        """A round of new names in one collective (``FreshSpec``); ``names`` / ``bufs`` None: this rank submitted
        something else. On a hit (every rank submitted ``spec.layout`` under the same names) ``bufs`` hold the result
        and the tensors are counted and on the timeline; their names stay out of the response cache (names made up
        per call would only evict the loop's). Returns (hit, the collective's end)."""
        pack(spec, self.rank, names, bufs)
        t0 = time.perf_counter()
        self._fresh_collective(spec)
        t1 = time.perf_counter()
        if names is None or bufs is None or not agreed(spec):
            self.stats["fresh_misses"] += 1
            return False, t1
        unpack(spec, bufs)
        self._fresh_done(names, t0, t1)
        return True, t1

    def fresh_one(self, spec: FreshSpec, name: str, buf: np.ndarray) -> bool:
        """``fresh`` of one tensor (the blocking ``allreduce``'s round of a new name): the same, fewer steps."""
        pack_one(spec, self.rank, name, buf)
        tl = self.timeline
        t0 = time.perf_counter() if tl is not None else 0.0
        self._fresh_collective(spec)
        stats = self.stats
        if not agreed(spec):
            stats["fresh_misses"] += 1
            return False
        if spec.postscale != 1.0:
            scale_inplace(spec.data, spec.postscale)
        buf[...] = spec.views[0]
        stats["allreduce_collectives"] += 1  # ``_fresh_done``, inline on this path
        stats["allreduce_tensors"] += 1
        if tl is not None:
            tl.event(name, "ALLREDUCE", t0, time.perf_counter(), fused=1, speculative=True)
        return True

    def _fresh_collective(self, spec: FreshSpec) -> None:
        try:
            self._staged(spec.staging, spec.op)
        except SparkHvdError:
            raise
        except Exception as exc:
            raise self.speculation_failed(exc) from exc
        self.stats["fresh_rounds"] += 1

    def _fresh_done(self, names: Sequence[str], t0: float, t1: float) -> None:
        stats = self.stats
        stats["allreduce_collectives"] += 1
        stats["allreduce_tensors"] += len(names)
        if len(names) > 1:
            stats["fused_collectives"] += 1
        tl = self.timeline
        if tl is not None:
            for name in names:
                tl.event(name, "ALLREDUCE", t0, t1, fused=len(names), speculative=True)

    def speculation_failed(self, exc: Exception) -> SparkHvdError:
        """A speculative round's one collective failed with an error not spark_hvd's own."""
        return SparkHvdError(f"allreduce of a speculative round failed on rank {self.rank}: {exc!r}; the ranks can "
                             "no longer be kept in step, so spark_hvd stopped")

    # ------------------------------------------------------------------ allreduce: fusion

    def _allreduces(self, key: tuple, items: list[Item]) -> None:
        device, dtype_str, op_value, prescale, postscale, bfloat16 = key
        group = self.group(device)
        dtype = np.dtype(dtype_str)
        op = ReduceOp(op_value)
        limit = float("inf") if group.fuses_in_place else max(int(self.settings.fusion_threshold), 0)
        chunk: list[tuple[TableEntry, Request | None, Any]] = []
        chunk_bytes = 0
        for entry, request in items:
            meta = entry.meta
            buf = request.buf if request is not None else group.placeholder(meta.shape, dtype, bfloat16, meta.op)
            nbytes = buf.nbytes
            self.cache.put(entry.name, meta)
            if nbytes >= group.direct_bytes:
                self._allreduce(group, op, prescale, postscale, bfloat16, [(entry, request, buf)])
                continue
            if chunk and chunk_bytes + nbytes > limit:
                self._allreduce(group, op, prescale, postscale, bfloat16, chunk)
                chunk, chunk_bytes = [], 0
            chunk.append((entry, request, buf))
            chunk_bytes += nbytes
        if chunk:
            self._allreduce(group, op, prescale, postscale, bfloat16, chunk)

    def _allreduce(self, group: Group, op: ReduceOp, prescale: float, postscale: float, bfloat16: bool,
                   chunk: list[tuple[TableEntry, Request | None, Any]]) -> None:
        stats = self.stats
        stats["allreduce_collectives"] += 1
        stats["allreduce_tensors"] += len(chunk)
        if len(chunk) > 1:
            stats["fused_collectives"] += 1
        if group.device:
            stats["device_collectives"] += 1
        t0 = time.perf_counter()
        try:
            phases = group.allreduce([buf for _, _, buf in chunk], op, prescale, postscale, bfloat16)
        except SparkHvdError:  # a peer failure, a closed backend: as it is
            raise
        except Exception as exc:
            names = [e.name for e, _, _ in chunk]
            raise self._failed(f"allreduce of {names[:5]}{'...' if len(names) > 5 else ''}", group, exc) from exc
        tl = self.timeline
        if tl is not None:
            for activity, start, end in phases or (("ALLREDUCE", t0, time.perf_counter()),):
                extra = {"fused": len(chunk)} if activity == "ALLREDUCE" else {}
                for entry, _, _ in chunk:
                    tl.event(entry.name, activity, start, end, **extra)
        # last first: a caller synchronizing in submission order then wakes once per group, not per tensor
        result = group.result
        finish_all([(request.handle, result(buf)) for _, request, buf in reversed(chunk) if request is not None])

    # ------------------------------------------------------------------ the other kinds

    def _one(self, entry: TableEntry, request: Request | None) -> None:
        meta = entry.meta if request is None else request.meta
        kind = meta.kind
        group = self.group(meta.device)
        self.stats[f"{kind}_collectives"] += 1
        if group.device:
            self.stats["device_collectives"] += 1
        if kind in CACHEABLE:  # before anything can fail: the caches of all ranks must stay identical
            self.cache.put(entry.name, entry.meta)
        t0 = time.perf_counter()
        try:
            if kind == "barrier":  # the one collective here a joined rank (``request`` None) takes part in
                group.barrier()
                result: Any = None
            elif request is None:  # pragma: no cover - the table fails these while a rank has joined
                raise SparkHvdError(f"{kind} of '{entry.name}' reached rank {self.rank}, which has joined")
            elif kind == "broadcast":
                group.broadcast(request.buf, meta.root)
                result = group.result(request.buf)
            elif kind == "allgather":
                result = group.allgather(request.buf)
            elif kind == "alltoall":
                out, recv_splits = group.alltoall(request.buf, request.splits or [])
                result = (out, list(recv_splits))
            elif kind == "reducescatter":
                result = group.reducescatter(request.buf, ReduceOp(meta.op), meta.prescale, meta.postscale,
                                             meta.bfloat16)
            else:  # pragma: no cover - enqueue rejects unknown kinds
                raise SparkHvdError(f"unknown collective {kind!r}")
        except SparkHvdError:  # a peer failure, a closed backend: as it is
            raise
        except Exception as exc:
            raise self._failed(f"{kind} of '{entry.name}'", group, exc) from exc
        if request is not None:
            if self.timeline is not None:
                self.timeline.event(entry.name, kind.upper(), t0, time.perf_counter())
            request.handle._set_result(result)

    def _failed(self, what: str, group: Group, exc: Exception) -> SparkHvdError:
        where = f" on {group.device}" if group.device else ""
        return SparkHvdError(f"{what}{where} failed on {self.scope.label(self.rank)}: {exc!r}; the ranks can no "
                             "longer be kept in step, so spark_hvd stopped")


def _open_device_group(device: str, backend: Backend, settings: Settings, scope: GroupScope) -> DeviceGroup:
    """Set up the group for ``device`` among ``scope``'s ranks (collective over them: each calls it in the same
    round of their engine). torch is imported here, at the first device collective, never before."""
    from spark_hvd.core.engine.torch_device import TorchDeviceGroup

    kind = check_device_backend(settings.device_backend)
    if kind in (None, "none"):
        kind = "nccl" if device == "cuda" else "gloo"
    return TorchDeviceGroup(device, kind, backend, settings, scope)
