"""The negotiation table: which tensors are ready on every rank, which mismatch, which stall.

Thread-free and rank-free: every rank of a job keeps one ``NegotiationTable`` and feeds it the same gathered
messages in the same order, so every rank's table is identical and every rank reaches the same answer without a
coordinator (see ``spark_hvd.core.engine.engine`` for the rounds that feed it):

- a tensor is *ready* when every rank that has not joined has submitted it; ready tensors come out in one order
  (first appearance: round, then rank, then submission order), so tensors submitted in different orders on
  different ranks still meet;
- the same name with a different shape, dtype, op or device on different ranks comes out with a
  ``TensorMismatchError`` naming the tensor and the ranks that disagree; an allgather, alltoall, reducescatter or
  broadcast while a rank has joined comes out with one too (Horovod's rule);
- a tensor that some ranks have not submitted for ``stall_check_time_s`` gets a warning naming the missing ranks;
  after ``stall_shutdown_time_s`` (by any rank's clock: each reports its own ``expired`` names) every rank raises a
  ``StallError`` naming it.

The round's wire format lives here too: the message every rank contributes to the full round's allgather (JSON,
length-prefixed, never unpickled), and the fast round's vector (a 1 at each response-cache id a rank submits).
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from spark_hvd.core.engine.device import GroupScope
from spark_hvd.core.engine.negotiation import Meta, ResponseCache, TableEntry
from spark_hvd.core.errors import SparkHvdError, StallError, TensorMismatchError

_LEN = struct.Struct("!I")
_NOT_WITH_JOIN = frozenset({"allgather", "alltoall", "reducescatter", "broadcast"})  # fail while a rank has joined

Ready = list[tuple[TableEntry, TensorMismatchError | None]]


class News(NamedTuple):
    """What the gathered messages of a full round said besides the tensors they added to the table."""

    joins: list[int]  # ranks that joined in this round
    shutdown: list[int]  # ranks that shut down
    expired: set[str]  # names some rank finds older than the stall-shutdown time
    progress: bool  # some rank submitted something or joined


class NegotiationTable:
    """The outstanding tensors (name -> which ranks submitted it, with what metadata) and the joined ranks.

    Args:
        size: the number of ranks (of the process set, for a set's engine).
        scope: whose ranks these are (messages name global ranks); the whole job when None.
        stall_check_time_s / stall_shutdown_time_s: when a tensor is warned about / stops the job (<= 0: never).
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, size: int, scope: GroupScope | None = None, stall_check_time_s: float = 60.0,
                 stall_shutdown_time_s: float = 0.0, clock: Any = time.monotonic) -> None:
        self.size = size
        self.scope = scope or GroupScope(0, tuple(range(size)))
        self.stall_check_time_s = stall_check_time_s
        self.stall_shutdown_time_s = stall_shutdown_time_s
        self.clock = clock
        self.pending: dict[str, TableEntry] = {}
        self.joined: set[int] = set()

    @property
    def idle(self) -> bool:
        """Nothing outstanding and nobody joined (identical on every rank: the fast rounds' precondition)."""
        return not (self.pending or self.joined)

    def add(self, name: str, rank: int, meta: Meta) -> None:
        """``rank`` submitted ``name`` with ``meta``."""
        entry = self.pending.get(name)
        if entry is None:
            entry = self.pending[name] = TableEntry(name, meta)
            entry.created = self.clock()
        entry.metas[rank] = meta

    def absorb(self, messages: Sequence[Sequence[Any]], cache: ResponseCache) -> News:
        """Add what a full round's gathered messages (one per rank, in rank order) submitted.

        A message is ``[join flag, shutdown flag, cache ids, full requests (Meta.to_wire), expired names, ...]``.
        """
        joins: list[int] = []
        shutdown: list[int] = []
        expired: set[str] = set()
        progress = False
        for r, (jf, sf, r_ids, r_full, r_expired, *_) in enumerate(messages):
            if sf:
                shutdown.append(r)
            if jf:
                self.joined.add(r)
                joins.append(r)
                progress = True
            for cache_id in r_ids:
                name, meta = cache.get(int(cache_id))
                self.add(name, r, meta)
            for item in r_full:
                name, meta = Meta.from_wire(item)
                self.add(name, r, meta)
            expired.update(str(name) for name in r_expired)
            progress = progress or bool(r_ids) or bool(r_full)
        return News(joins, shutdown, expired, progress)

    def ready(self) -> Ready:
        """Take the tensors every active rank has submitted out of the table, each with its mismatch (or None)."""
        size = self.size
        joined = self.joined
        active = [r for r in range(size) if r not in joined]
        ready = []
        for entry in list(self.pending.values()):
            if len(entry.metas) == size if not joined else all(r in entry.metas for r in active):
                del self.pending[entry.name]
                ready.append((entry, self.mismatch(entry)))
        return ready

    def all_joined(self) -> bool:
        """Every rank has joined (the join completes; ``clear_joins`` starts afresh)."""
        return bool(self.joined) and len(self.joined) == self.size

    def clear_joins(self) -> None:
        """Forget the joins (after a join has completed on every rank)."""
        self.joined.clear()

    def mismatch(self, entry: TableEntry) -> TensorMismatchError | None:
        """The error every rank raises for ``entry``, or None when its ranks agree."""
        metas = list(entry.metas.values())
        meta = metas[0]
        same = True
        for m in metas:
            if m != meta:
                same = False
                break
        if same or len({m.agreement_key() for m in metas}) == 1:
            joined = sorted(r for r in self.joined if r not in entry.metas)
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
            return device_mismatch(entry.name, devices, self.in_set())
        keys = {g[r]: m.agreement_key() for r, m in entry.metas.items()}
        distinct = set(keys.values())
        counts = Counter(keys.values())
        lowest = min(keys)
        common = max(distinct, key=lambda k: (counts[k], k == keys[lowest]))
        bad = sorted(r for r, k in keys.items() if k != common)
        detail = "; ".join(f"rank {g[r]}: {m.describe()}" for r, m in sorted(entry.metas.items()))
        return TensorMismatchError(
            f"tensor '{entry.name}'{self.in_set()} was submitted differently on different ranks (ranks {bad} differ "
            f"from the others): {detail}. Every rank must submit the same shape, dtype and op under one name.",
            name=entry.name, ranks=bad)

    def in_set(self) -> str:
        """`` in process set 1 (ranks [1, 2])`` for a process set's table, else nothing."""
        ps = self.scope.process_set
        return f" in process set {ps} (ranks {list(self.scope.ranks)})" if ps else ""

    def missing(self, entry: TableEntry) -> list[int]:
        """The ranks (of this table) that have neither submitted ``entry`` nor joined."""
        return [r for r in range(self.size) if r not in entry.metas and r not in self.joined]

    # ------------------------------------------------------------------ stalls

    def expired(self) -> list[str]:
        """Outstanding tensors older than the stall-shutdown time by this rank's clock (at most 5, oldest first).

        Each rank reports its own in its message; every rank acts on the union in the same round (``stall_error``).
        """
        limit = self.stall_shutdown_time_s
        if not self.pending or limit <= 0:
            return []
        now = self.clock()
        old = sorted((e.created, e.name) for e in self.pending.values() if now - e.created >= limit)
        return [name for _, name in old[:5]]

    def stall_error(self, names: set[str]) -> StallError | None:
        """The error that stops the job on every rank for the stalled ``names`` (None: they completed)."""
        entries = sorted((e for n, e in self.pending.items() if n in names), key=lambda e: (e.created, e.name))
        if not entries:  # they completed in this very round
            return None
        now = self.clock()

        def missing(entry: TableEntry) -> list[int]:  # as global ranks
            return self.scope.global_ranks(self.missing(entry))

        first = entries[0]
        text = (f"stall: tensor '{first.name}'{self.in_set()} was submitted by ranks "
                f"{self.scope.global_ranks(sorted(first.metas))} "
                f"{now - first.created:.0f} s ago but ranks {missing(first)} never submitted it within "
                "SPARK_HVD_STALL_SHUTDOWN_TIME="
                f"{self.stall_shutdown_time_s:g} s, so spark_hvd stopped the job on every rank; one of "
                "them may be stuck or running a different code path")
        if len(entries) > 1:
            text += "; also stalled: " + ", ".join(f"'{e.name}' (missing ranks {missing(e)})" for e in entries[1:])
        return StallError(text, name=first.name, ranks=missing(first))

    def stall_warnings(self, rank: int) -> list[str]:
        """Warnings for the tensors ``rank`` submitted that others have not for ``stall_check_time_s`` (each
        warned again only after as long again)."""
        limit = self.stall_check_time_s
        if not self.pending or limit <= 0:
            return []
        now = self.clock()
        warnings = []
        for entry in self.pending.values():
            if now - entry.created >= limit and now - entry.warned >= limit:
                entry.warned = now
                if rank not in entry.metas:
                    continue
                warnings.append(
                    f"stall: tensor '{entry.name}' was submitted by ranks {sorted(entry.metas)} "
                    f"{now - entry.created:.0f} s ago but ranks {self.missing(entry)} have not submitted it; one of "
                    "them may be stuck or running a different code path")
        return warnings


# ---------------------------------------------------------------------- the rounds' wire format

def message_digest(message: np.ndarray) -> tuple[int, int]:
    """A 60-bit digest of one rank's full-round message as two positive int32 values (each with bit 30 set, so
    a digest is never zero): what the fast round carries so that ranks whose messages are all the same skip the
    round that would move them (``same_messages``)."""
    h = int.from_bytes(hashlib.blake2b(message.tobytes(), digest_size=8).digest(), "little")
    return (h & 0x3FFFFFFF) | 0x40000000, ((h >> 30) & 0x3FFFFFFF) | 0x40000000


#: Slots of the fast round's vector that carry autotune's choice (``spark_hvd.core.engine.autotune.Point.encode``).
TUNE_SLOTS = 3


def fast_vector(ids: Sequence[int], irregular: bool, id_count: int, rank: int = 0, size: int = 1,
                length: int = 0, digest: tuple[int, int] = (0, 0), tune: tuple[int, ...] = (0, 0, 0)) -> np.ndarray:
    """A fast round's contribution, SUM-reduced over the ranks:
    ``[irregular, lengths..., digests..., tune (3), ids...]``.

    A 1 in front when this rank has anything else to say (a new tensor, a join, a shutdown); at ``1 + rank`` the
    length of this rank's full-round message (so that, when a full round follows, every rank knows where every
    message lies and the messages travel in one allreduce, see ``message_lengths``); at ``1 + size + 2 rank`` the
    message's digest (``message_digest``: when every rank's message is the same, none needs to travel, see
    ``same_messages``); at ``1 + 3 size`` three slots only rank 0 writes, the settings autotune switches every rank
    to in this round (``tune_slots``, ``spark_hvd.core.engine.autotune``); a 1 at ``4 + 3 size + id`` for each cache id
    submitted (none when irregular: the full round carries them). Every slot but the ids' is one rank's alone, so
    the sum is exact."""
    head = 1 + 3 * size + TUNE_SLOTS
    vec = np.zeros(head + id_count, np.int32)
    vec[1 + rank] = length
    vec[1 + size + 2 * rank:3 + size + 2 * rank] = digest
    if tune[0]:
        vec[head - TUNE_SLOTS:head] = tune
    if irregular:
        vec[0] = 1
    elif ids:
        vec[head + np.asarray(ids)] = 1
    return vec


def fast_answer(summed: np.ndarray, size: int) -> tuple[list[int], bool] | None:
    """What the summed fast vectors say: None when some rank needs the full round, else the ids every rank
    submitted (in id order: the order they run in) and whether some ids were submitted by only some ranks."""
    if summed[0]:
        return None
    counts = summed[1 + 3 * size + TUNE_SLOTS:]
    common = np.flatnonzero(counts == size).tolist()
    return common, len(common) < np.count_nonzero(counts)


def tune_slots(summed: np.ndarray, size: int) -> tuple[int, ...]:
    """The autotune slots of the summed fast vectors (zeros: no switch this round)."""
    at = 1 + 3 * size
    return tuple(summed[at:at + TUNE_SLOTS].tolist())


def message_lengths(summed: np.ndarray, size: int) -> list[int]:
    """Every rank's full-round message length, from the summed fast vectors."""
    return [int(n) for n in summed[1:1 + size]]


def same_messages(summed: np.ndarray, size: int) -> bool:
    """Whether every rank's full-round message is the same (same length and digest, from the summed fast vectors;
    a digest is never zero, so a rank that sent none fails this). Then each rank holds every rank's message: its
    own, and the round that would gather them is skipped. Two different messages pass only when their 60-bit
    digests collide (odds ~1e-18 per pair of ranks and round)."""
    head = summed[1:1 + 3 * size].tolist()  # small: plain Python compares faster than numpy here
    lengths, digests = head[:size], head[size:]
    return bool(digests[0]) and lengths.count(lengths[0]) == size and digests[0::2].count(digests[0]) == size \
        and digests[1::2].count(digests[1]) == size


def place_message(message: np.ndarray, lengths: Sequence[int], rank: int) -> np.ndarray:
    """A zero buffer of every rank's message length with this rank's message in its place: SUM-reduced over the
    ranks (exactly: one rank is nonzero at each byte) it holds every message, which ``decode_messages`` reads."""
    buf = np.zeros(sum(lengths), np.uint8)
    at = sum(lengths[:rank])
    buf[at:at + lengths[rank]] = message
    return buf


def encode_message(fields: list[Any]) -> np.ndarray:
    """One rank's full-round message as the bytes the ranks allgather (length-prefixed JSON)."""
    payload = json.dumps(fields, separators=(",", ":")).encode()
    return np.frombuffer(_LEN.pack(len(payload)) + payload, dtype=np.uint8)


def decode_messages(gathered: np.ndarray, size: int) -> list[list]:
    """The ``size`` messages of an allgather of ``encode_message`` outputs, in rank order."""
    data = gathered.tobytes()
    messages = []
    offset = 0
    for r in range(size):
        if offset + _LEN.size > len(data):
            raise SparkHvdError(f"negotiation message of rank {r} is missing (got {len(data)} bytes)")
        (length,) = _LEN.unpack_from(data, offset)
        offset += _LEN.size
        messages.append(json.loads(data[offset:offset + length]))
        offset += length
    return messages


def check_same_settings(configs: Sequence[Sequence[int]]) -> None:
    """Fail when the ranks' ``[fusion_threshold, cache_capacity]`` differ (every rank must plan alike)."""
    if all(list(c) == list(configs[0]) for c in configs):
        return
    detail = "; ".join(f"rank {r}: fusion_threshold={c[0]} cache_capacity={c[1]}" for r, c in enumerate(configs))
    raise SparkHvdError("the ranks of this job run with different SPARK_HVD_FUSION_THRESHOLD / "
                        f"SPARK_HVD_CACHE_CAPACITY ({detail}); every rank must use the same values")


def device_mismatch(name: str, devices: dict[int, str], in_set: str = "") -> TensorMismatchError:
    """The error for one tensor on the GPU on some ranks and in host memory (or another device) on others."""
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
