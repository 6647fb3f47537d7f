"""Slice collectives among the ranks of one host, over a ``ShmGroup``: the inner legs of the hierarchical allreduce.

An array split into one slice per member (``bounds``): ``reduce_scatter`` leaves member i's slice reduced over
every member, ``allgather`` gives every member every member's slice. With them the hierarchical allreduce is
reduce-scatter within the host, an allreduce of each slice across hosts by the member that holds it, allgather
within the host; each member then copies ``(L - 1) / L`` of the array into shared memory and reduces ``1 / L`` of
it, where a full shared-memory allreduce followed by broadcasts copies and reduces the whole array on every member.

Both run as ``ShmGroup.rounds``: round b moves window b (``w`` elements) of every slice. In the reduce-scatter a
member stages its window of every *other* member's slice (``L - 1`` windows per slot) and adds the peers' windows
of its own slice into place, always in the same peer order; in the allgather it stages its own slice's window and
copies each peer's window out. The ring backend's reducescatter and allgather on one host are these two
(``ring_plans.ShmHost``), their metadata one round of ``allgather_bytes``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.reduce import reduce_into
from spark_hvd.core.transport.shm import ShmGroup


def _windows(parts: Sequence[np.ndarray], w: int) -> tuple[int, Callable[[int, int], np.ndarray]]:
    """(number of rounds, ``window(j, b)``: the view of part j's round-b window, possibly empty)."""
    if w <= 0:
        raise ValueError(f"a shared-memory block of {w} elements per slice cannot carry slices of {parts[0].dtype}")
    longest = max(p.size for p in parts)

    def window(j: int, b: int) -> np.ndarray:
        lo = b * w
        return parts[j][lo:max(lo, min(parts[j].size, lo + w))]

    return -(-longest // w), window


def split(flat: np.ndarray, bounds: Sequence[int], members: int) -> list[np.ndarray]:
    """The views ``flat[bounds[i]:bounds[i+1]]``, one per member, after checking ``bounds``."""
    if len(bounds) != members + 1 or bounds[0] != 0 or bounds[-1] != flat.size:
        raise ValueError(f"bounds {list(bounds)[:8]} do not split {flat.size} elements into {members} slices")
    return [flat[lo:hi] for lo, hi in zip(bounds, bounds[1:], strict=False)]


def reduce_scatter(group: ShmGroup, flat: np.ndarray, bounds: Sequence[int], op: ReduceOp, bfloat16: bool,
                   operation: str, check_peers: Callable[[str], None]) -> None:
    """Reduce ``flat`` (flat, contiguous) across the members into member i's slice ``bounds[i]:bounds[i+1]``, in
    place (the other slices are left as they were). ``op`` AVERAGE sums: divide afterwards."""
    reduce_scatter_parts(group, split(flat, bounds, group.size), op, bfloat16, operation, check_peers)


def reduce_scatter_parts(group: ShmGroup, parts: Sequence[np.ndarray], op: ReduceOp, bfloat16: bool,
                         operation: str, check_peers: Callable[[str], None]) -> None:
    """``reduce_scatter`` over one flat view per member (``parts[i]``, same dtype, any lengths the members agree
    on): afterwards ``parts[i]`` of member i holds the reduction of every member's ``parts[i]``."""
    size, me, dtype = group.size, group.local, parts[0].dtype
    w = group.block_bytes // dtype.itemsize // max(1, size - 1)
    nblocks, window = _windows(parts, w)

    def at(j: int, k: int) -> int:
        """Where member k stages part j's window in its slot (k skips its own part)."""
        return (j - (j > k)) * w

    def stage(b: int, slot: np.ndarray) -> None:
        slot = slot.view(dtype)
        for j in range(size):
            if j != me:
                part = window(j, b)
                slot[at(j, me):at(j, me) + part.size] = part

    def consume(b: int, k: int, slot: np.ndarray) -> None:
        mine = window(me, b)
        if mine.size:
            reduce_into(mine, slot.view(dtype)[at(me, k):at(me, k) + mine.size], op, bfloat16)

    group.rounds(nblocks, stage, consume, operation, check_peers)


def allgather(group: ShmGroup, flat: np.ndarray, bounds: Sequence[int], operation: str,
              check_peers: Callable[[str], None]) -> None:
    """Member i holds slice ``bounds[i]:bounds[i+1]`` of ``flat``; afterwards every member holds every slice."""
    allgather_parts(group, split(flat, bounds, group.size), operation, check_peers)


def allgather_parts(group: ShmGroup, parts: Sequence[np.ndarray], operation: str,
                    check_peers: Callable[[str], None]) -> None:
    """``allgather`` over one flat view per member: member i's ``parts[i]`` is copied into every member's."""
    me, dtype = group.local, parts[0].dtype
    nblocks, window = _windows(parts, group.block_bytes // dtype.itemsize)

    def stage(b: int, slot: np.ndarray) -> None:
        part = window(me, b)
        slot.view(dtype)[:part.size] = part

    def consume(b: int, k: int, slot: np.ndarray) -> None:
        part = window(k, b)
        part[...] = slot.view(dtype)[:part.size]

    group.rounds(nblocks, stage, consume, operation, check_peers)


def allgather_bytes(group: ShmGroup, payload: bytes, operation: str, check_peers: Callable[[str], None]) -> list[bytes]:
    """Every member's small ``payload`` (its length and bytes in one slot: one round), by member."""
    if len(payload) + 8 > group.block_bytes:
        raise ValueError(f"{operation}: a payload of {len(payload)} bytes does not fit a shared-memory block of "
                         f"{group.block_bytes}")
    out = [b""] * group.size
    out[group.local] = payload

    def stage(b: int, slot: np.ndarray) -> None:
        slot[:8].view(np.int64)[0] = len(payload)
        slot[8:8 + len(payload)] = np.frombuffer(payload, np.uint8)

    def consume(b: int, k: int, slot: np.ndarray) -> None:
        n = int(slot[:8].view(np.int64)[0])
        out[k] = slot[8:8 + n].tobytes()

    group.rounds(1, stage, consume, operation, check_peers)
    return out


__all__ = ["reduce_scatter", "reduce_scatter_parts", "allgather", "allgather_bytes", "allgather_parts", "split"]
