"""What the ranks negotiate: a tensor's metadata, the outstanding-tensor table's entries, the response cache.

Everything here is state that the engine keeps identical on every rank (see ``spark_hvd.core.engine.engine``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from spark_hvd.core.errors import SparkHvdError

KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier")
CACHEABLE = frozenset({"allreduce", "broadcast", "reducescatter", "barrier"})
RAGGED = frozenset({"allgather", "alltoall"})  # the first dimension may differ by rank


def noname(kind: str, n: int) -> str:
    """The name the engine gives the ``n``-th operation of ``kind`` submitted without one on a rank (the same on
    every rank that submits in the same order)."""
    return f"{kind}.noname.{n}"


#: How the names the engine makes up for allreduces begin (``noname("allreduce", n)``): a named call on the path of
#: every round of new names pays one ``startswith`` against it.
MADE_UP_ALLREDUCE = "allreduce.noname."


def made_up(name: str, kind: str) -> bool:
    """Whether ``name`` is one the engine made up (``noname``): a per-rank counter's, never submitted again."""
    return name.startswith(kind) and name.startswith(".noname.", len(kind))


class Meta(NamedTuple):
    """What every rank must agree on for one named tensor."""

    kind: str
    dtype: str
    shape: tuple[int, ...]
    op: str
    root: int
    prescale: float
    postscale: float
    bfloat16: bool
    device: str = ""  # "" in host memory; a device kind ("cuda") for a DeviceBuffer (spark_hvd.core.engine.device)

    def to_wire(self, name: str) -> list:
        return [name, self.kind, self.dtype, list(self.shape), self.op, self.root, self.prescale, self.postscale,
                self.bfloat16, self.device]

    @classmethod
    def from_wire(cls, item: list) -> tuple[str, Meta]:
        name, kind, dtype, shape, op, root, pre, post, bf16, device = item
        return str(name), cls(str(kind), str(dtype), tuple(int(s) for s in shape), str(op), int(root), float(pre),
                              float(post), bool(bf16), str(device))

    def agreement_key(self) -> tuple:
        if self.kind in RAGGED:
            return (self.kind, self.dtype, self.shape[1:], self.bfloat16, self.device)
        return tuple(self)

    def describe(self) -> str:
        dtype = "bfloat16" if self.bfloat16 else (np.dtype(self.dtype).name if self.dtype else "-")
        text = f"{self.kind} shape={self.shape} dtype={dtype}"
        if self.kind in ("allreduce", "reducescatter"):
            text += f" op={self.op}"
            if self.prescale != 1.0 or self.postscale != 1.0:
                text += f" prescale={self.prescale} postscale={self.postscale}"
        if self.kind == "broadcast":
            text += f" root={self.root}"
        if self.device:
            text += f" on {self.device}"
        return text


class TableEntry:
    """One outstanding tensor in the table every rank keeps identical (``meta``: the first rank's)."""

    __slots__ = ("name", "meta", "metas", "created", "warned")

    def __init__(self, name: str, meta: Meta) -> None:
        self.name = name
        self.meta = meta
        self.metas: dict[int, Meta] = {}
        self.created = time.monotonic()
        self.warned = 0.0


class ResponseCache:
    """LRU of agreed metadata by name, with small integer ids; updated identically on every rank."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(int(capacity), 0)
        self._by_name: OrderedDict[str, tuple[int, Meta]] = OrderedDict()
        self._by_id: dict[int, tuple[str, Meta]] = {}
        self._free: list[int] = []
        self._next = 0
        #: bumped whenever an id that meant something comes to mean another (name, metadata): a name whose metadata
        #: changed, an eviction; a new name on an id never handed out before changes no id's meaning
        self.version = 0

    def lookup(self, name: str, meta: Meta) -> int | None:
        hit = self._by_name.get(name)
        if hit is not None and hit[1] == meta:
            return hit[0]
        return None

    def get(self, cache_id: int) -> tuple[str, Meta]:
        try:
            return self._by_id[cache_id]
        except KeyError:
            raise SparkHvdError(f"response cache id {cache_id} is unknown on this rank: the ranks' caches "
                                "diverged (a bug; please report it)") from None

    def put(self, name: str, meta: Meta) -> None:
        if self.capacity == 0:
            return
        hit = self._by_name.get(name)
        if hit is not None:
            if hit[1] is meta or hit[1] == meta:
                self._by_name.move_to_end(name)
                return
            cache_id = hit[0]
            del self._by_name[name]
        elif len(self._by_name) >= self.capacity:
            _, (cache_id, _) = self._by_name.popitem(last=False)
            del self._by_id[cache_id]
        elif self._free:
            cache_id = self._free.pop()
        else:  # an id never handed out: what every other id means is unchanged
            cache_id = self._next
            self._next += 1
            self._by_name[name] = (cache_id, meta)
            self._by_id[cache_id] = (name, meta)
            return
        self._by_name[name] = (cache_id, meta)
        self._by_id[cache_id] = (name, meta)
        self.version += 1

    def __len__(self) -> int:
        return len(self._by_name)

    def id_count(self) -> int:
        """How many ids were ever handed out (ids are ``0 .. id_count() - 1``); identical on every rank."""
        return self._next


_BF16_BITS = {"one": 0x3F80, "inf": 0x7F80, "-inf": 0xFF80}


def reduction_identity(shape: tuple[int, ...], dtype: np.dtype, op: str, bfloat16: bool) -> np.ndarray:
    """What a joined rank contributes to a reduction: the identity of ``op``."""
    if op in ("sum", "average", "adasum"):  # adasum(a, 0) = a
        return np.zeros(shape, dtype)
    if bfloat16:
        value = {"product": "one", "min": "inf", "max": "-inf"}[op]
        return np.full(shape, _BF16_BITS[value], np.uint16)
    if op == "product":
        return np.ones(shape, dtype)
    if np.issubdtype(dtype, np.floating):
        return np.full(shape, np.inf if op == "min" else -np.inf, dtype)
    info = np.iinfo(dtype)
    return np.full(shape, info.max if op == "min" else info.min, dtype)
