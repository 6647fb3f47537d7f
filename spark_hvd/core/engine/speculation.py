"""Speculative rounds: which round the ranks expect next, and the one collective that carries it.

Thread-free and rank-free, like the table (``spark_hvd.core.engine.table``): every rank feeds its ``Predictor`` the same
clean rounds (the response-cache ids every rank submitted, from a fast round or a speculative hit) and so arms the
same ``Spec`` at the same moment.

The predictor learns which round follows which: after a clean round of ids ``C`` it looks up the round that follows
``C`` (the first one seen, ``C`` itself once seen after ``C``, or one seen twice in a row after ``C``) and arms a
speculation on it. After a round with no successor seen yet it expects the same round again (a training step
repeats its tensors), where a wrong guess costs no more than the negotiation it stands in for (``_cheap_miss``);
the engine feeds it full rounds that left nothing outstanding too, so a loop of one tensor is speculative from its
second call. A steady loop of one tensor (``C`` followed by ``C``), two tensors alternating (``A, B, A, B``), an
allreduce between barriers (osu_allreduce's loop), a training step's gradients then its metric: each becomes a
cycle of predicted rounds of one collective each, negotiation and data together (between two ranks over TCP, one
larger tensor carries the flag as the first frame of its own collective: ``spark_hvd.core.algorithms.agreed``; a
round too large to pack, such as a training step's gradients, sends its flag alone ahead of the tensors' fused
collective where they lie: ``Spec.ahead``). A prediction that fails costs one collective (a small one, or a round
trip and the early frames of the larger tensor's). One other round after
``C`` now and then (a barrier or a metric between steady steps) leaves the prediction armed, so only that round
misses; a second one in a row that is not the prediction disarms it until a successor is seen twice in a row, so
an irregular pattern does not pay a miss on every round. A full round (new names, a join, a partial fast round)
breaks the context (``forget_last``); when a round changes what a cache id means (a name's metadata changed, an
eviction: the cache's ``version``), everything learned is forgotten (``reset``). A new name on a fresh id forgets
nothing: the benchmark's loops of two sizes in turn were otherwise relearnt from scratch when the second size first
appeared, and the first loop's next two calls missed. A round of names the engine made up (``allreduce(t)`` with no
name: ``allreduce.noname.N``, never submitted again) is learnt as the round ``NEW`` (``followed_by_new``): never
speculated on, but what follows it is, so ``barrier(); allreduce(t)`` unnamed in a loop speculates on its barriers
and guesses nothing after them (three collectives an iteration, against six when each was a broken context);
the engine then expects the made-up names by their layout (``expects_new``, ``spark_hvd.core.engine.fresh``): two.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.engine.negotiation import Meta

#: Rounds of at most this many bytes are run speculatively, packed into one staging array.
SPEC_BYTES = 64 * 1024
#: Among three or more ranks on a backend that does not reduce in place (TCP), rounds of up to this many bytes are
#: packed too: the copy in and out costs less than the fast round it saves (a log-depth exchange among N ranks;
#: measured at 1 MiB, np=8 on loopback; on a fast network the copies of larger rounds would cost more than the
#: round trips they save). Their staging arrays share one scratch buffer per dtype (``Predictor``), so memory does
#: not grow with the rounds learned.
SPEC_LARGE_BYTES = 1024 * 1024
#: The element-wise reductions an in-band speculation may carry (``Spec.in_band``: the flag is not reduced).
_IN_BAND_OPS = ("sum", "average", "min", "max", "product")
_MAX_LEARNED = 4096  # rounds remembered (a loop with more distinct rounds than this is forgotten and relearned)

Ids = tuple[int, ...]
#: The round of names the engine made up (``negotiation.made_up``): learnt like a round, never speculated on
NEW: Ids = ()


class Spec(NamedTuple):
    """A round every rank expects: these cache ids, one small float SUM/AVERAGE group, or barriers alone.

    The round is then a single allreduce of ``[flag, tensors...]``: every rank whose submissions are exactly
    ``ids`` packs its tensors and a flag of 1, any other rank zeros. When the flags add up to the job size, the
    packed part is the answer (negotiation and data in one collective; for barriers, the flag's collective is the
    barrier: no rank's flag is counted before it arrived); otherwise every rank drops it, disarms, and negotiates
    the round as usual, having spent one small collective.

    ``in_place``: two ranks on a backend that reduces several arrays where they lie (shared memory), one float
    tensor larger than ``SPEC_BYTES``, SUM without prescale. Packing it would cost more than the negotiation it
    saves, so the collective is ``allreduce_fused([flag], tensor)`` on the tensor itself; a rank that did not submit
    exactly it contributes -0.0 instead, which leaves every float (-0.0 included) as it is, so on a miss the one rank
    that did keeps its tensor bit for bit (with three or more ranks two could match and mix: not armed there).

    ``ahead``: a round too large to pack and not one tensor in place (a training step's gradients, one large
    AVERAGE), on a backend that reduces many arrays where they lie (``fuses_in_place``): the flag goes alone in a
    small SUM collective (``staging`` is ``[flag]``), and on a hit the tensors go in one fused collective where they
    lie, as the negotiated round would run them (the same op, scales and order). It replaces the fast round's
    vector and its answer with one flag; a miss costs that flag's collective and changes no tensor.

    ``in_band``: one tensor without prescale (any dtype the backend takes, any element-wise op) on a backend that
    carries the flag as a header of the data collective itself (``Backend.allreduce_agreed``): two ranks over TCP
    and a tensor larger than ``SPEC_BYTES``, or any number of ranks on one host's shared memory and a tensor within
    ``Backend.agrees_small`` (the flag ahead of the data in the slot). The collective runs on the tensor where it
    lies, and on a miss no rank's tensor changes. ``staging`` is then empty (a round of barriers carried so: the
    flag with no data after it).
    """

    ids: Ids
    dtype: np.dtype
    op: ReduceOp
    prescale: float
    postscale: float
    count: int
    sole: tuple[str, Meta] | None  # (name, metadata) when the round is one tensor: ``Engine.allreduce`` matches it
    staging: np.ndarray  # [flag, tensors...], this speculation's own ([flag] when in_place or barriers)
    views: tuple[np.ndarray, ...]  # each tensor's place in ``staging``, in its shape (packing is one copy each)
    in_place: bool
    barrier: bool  # the round is barriers only (no data)
    in_band: bool = False  # the flag travels ahead of the tensor in its own collective (``allreduce_agreed``)
    entries: tuple[tuple[str, Meta], ...] = ()  # each id's (name, metadata), in id order: what a hit puts in the cache
    ahead: bool = False  # the flag's own small collective, then the tensors' fused collective where they lie


def build_spec(ids: Ids, lookup: Callable[[int], tuple[str, Meta]], size: int, fuses_in_place: bool,
               scratch: Callable[[np.dtype, int], np.ndarray] | None = None, in_band: bool = False,
               agrees_small: Callable[[np.dtype, ReduceOp], int] | None = None) -> Spec | None:
    """The speculation for a round of ``ids`` (``lookup``: the response cache), or None when it cannot be one.

    ``scratch(dtype, n)``: a zeroed-or-not array of ``n`` items, shared between speculations (rounds run one at a
    time), for the staging of rounds above ``SPEC_BYTES``; None: every speculation gets its own. ``in_band``: the
    backend's ``agrees_in_band``; ``agrees_small``: its ``agrees_small`` (one small tensor then carries the flag in
    band too, with no staging copy, among any number of ranks)."""
    entries = [lookup(cache_id) for cache_id in ids]
    metas = [meta for _, meta in entries]
    if all(m.kind == "barrier" for m in metas):  # the flag alone: in band, with nothing after it, where it can be
        flag_in_band = agrees_small is not None and agrees_small(np.dtype(np.float32), ReduceOp.SUM) > 0
        return Spec(ids, np.dtype(np.float32), ReduceOp.SUM, 1.0, 1.0, 0, None,
                    np.zeros(0 if flag_in_band else 1, np.float32), (), False, True, flag_in_band, tuple(entries))
    first = metas[0]
    dtype = np.dtype(first.dtype)
    if (len(ids) == 1 and first.kind == "allreduce" and not first.device and not first.bfloat16
            and first.prescale == 1.0 and first.op in _IN_BAND_OPS):
        count = int(np.prod(first.shape, dtype=np.int64))
        nbytes = count * dtype.itemsize
        if ((in_band and size == 2 and nbytes > SPEC_BYTES)
                or (agrees_small is not None and 0 < nbytes <= agrees_small(dtype, ReduceOp(first.op)))):
            return Spec(ids, dtype, ReduceOp(first.op), 1.0, first.postscale, count, entries[0],
                        np.zeros(0, dtype), (), False, False, True, tuple(entries))
    key = (first.dtype, first.op, first.prescale, first.postscale, False)
    same = all(m.kind == "allreduce" and not m.device and (m.dtype, m.op, m.prescale, m.postscale, m.bfloat16) == key
               for m in metas)
    count = sum(int(np.prod(m.shape, dtype=np.int64)) for m in metas)
    sole_in_place = size == 2 and len(ids) == 1 and first.op == "sum" and first.prescale == 1.0 and dtype.kind == "f"
    if (same and fuses_in_place and first.op in _IN_BAND_OPS and count * dtype.itemsize > SPEC_BYTES
            and not sole_in_place):
        return Spec(ids, dtype, ReduceOp(first.op), first.prescale, first.postscale, count,
                    entries[0] if len(ids) == 1 else None, np.zeros(1, np.float32), (), False, False, False,
                    tuple(entries), True)
    if dtype.kind != "f" or first.op not in ("sum", "average") or not same:  # (device tensors: never in staging)
        return None
    nbytes = count * dtype.itemsize
    large = SPEC_BYTES < nbytes <= SPEC_LARGE_BYTES and size >= 3 and not fuses_in_place
    packed = nbytes <= SPEC_BYTES or large
    in_place = (not packed and size == 2 and fuses_in_place and len(ids) == 1
                and first.op == "sum" and first.prescale == 1.0)
    if not (packed or in_place):
        return None
    sole = entries[0] if len(ids) == 1 else None
    if large and scratch is not None:
        staging = scratch(dtype, 1 + count)
    else:
        staging = np.zeros(1 if in_place else 1 + count, dtype)
    views, offset = [], 1
    for m in metas if packed else ():
        n = int(np.prod(m.shape, dtype=np.int64))
        views.append(staging[offset:offset + n].reshape(m.shape))
        offset += n
    return Spec(ids, dtype, ReduceOp(first.op), first.prescale, first.postscale, count, sole, staging, tuple(views),
                in_place, False, False, tuple(entries))


class Predictor:
    """Which clean round follows which, and the speculation to arm after each (identical on every rank).

    Args:
        lookup: the response cache's ``get`` (cache id -> name, metadata).
        size: the number of ranks.
        fuses_in_place: the backend reduces several arrays where they lie (an in-place speculation is possible).
        in_band: the backend carries the flag inside the data collective (``Backend.agrees_in_band``).
        version: the response cache's ``version``: when it moved (an id came to mean another tensor), everything
            learned is forgotten at the next round.
        agrees_small: the backend's ``agrees_small`` (one small tensor's round carries its flag in band).
    """

    def __init__(self, lookup: Callable[[int], tuple[str, Meta]], size: int, fuses_in_place: bool,
                 in_band: bool = False, version: Callable[[], int] | None = None,
                 agrees_small: Callable[[np.dtype, ReduceOp], int] | None = None) -> None:
        self._lookup = lookup
        self._version = version
        #: the response cache's version that what was learned holds for
        self.seen_version = version() if version is not None else 0
        self._size = size
        self._fuses = fuses_in_place
        self._in_band = in_band
        self._agrees_small = agrees_small
        self._last: Ids | None = None  # the last clean round with something in it
        self._before: Ids | None = None  # the one before it
        # round -> (the successor armed or None, the round after it last time, that one contradicted the armed one)
        self._follows: dict[Ids, tuple[Ids | None, Ids, bool]] = {}
        # the same for the last two rounds (``_before``, ``_last``): asked first, so a round whose successor depends
        # on the one before it (a barrier after each of two loops, a metric every few steps) is predicted as well
        self._follows2: dict[tuple[Ids, Ids], tuple[Ids | None, Ids, bool]] = {}
        self._specs: dict[Ids, Spec | None] = {}  # built once per round (None: not speculable)
        #: the round a steady loop repeats (``advance`` of it again, at this cache ``seen_version``, would change
        #: nothing and arm its own speculation again), else None: a caller may skip that ``advance``
        self.steady: Ids | None = None
        self._scratch: dict[str, np.ndarray] = {}  # the shared staging of large speculations, by dtype
        # transitions that taught nothing: (before, last, now) -> (the tables' epoch then, the speculation armed);
        # while no table changed since (``_epoch``), ``advance`` of that round from that state is a lookup (a cycle
        # of rounds, osu_allreduce's barrier and allreduce, repeats its transitions)
        self._stable: dict[tuple[Ids | None, Ids | None, Ids], tuple[int, Spec | None]] = {}
        self._epoch = 0

    def advance(self, common: list[int] | Ids) -> Spec | None:
        """A clean round agreed on ``common`` (in id order): learn, and return the speculation for the next round.

        An empty round (a heartbeat) teaches nothing and keeps the prediction made before it.
        """
        if self._version is not None and self._version() != self.seen_version:
            self.reset()
            self.seen_version = self._version()
        self.steady = None
        if common:
            now = common if common.__class__ is tuple else tuple(common)
            if now == self._last and now == self._before and self._follows2.get((now, now)) == (now, now, False):
                spec = self._spec(now)  # a steady loop's next round: learning it again would change nothing
                self.steady = now
                return spec
            key = (self._before, self._last, now)
            stable = self._stable.get(key)
            if stable is not None and stable[0] == self._epoch:
                self._before, self._last = self._last, now
                return stable[1]
            if len(self._follows) >= _MAX_LEARNED or len(self._follows2) >= _MAX_LEARNED:
                self.reset()
            epoch = self._epoch
            if self._last is not None:
                self._epoch += _learn(self._follows, self._last, now)
                if self._before is not None:
                    self._epoch += _learn(self._follows2, (self._before, self._last), now)
            self._before, self._last = self._last, now
            spec = self.predict()
            if self._epoch == epoch:  # (``predict`` may build a speculation: that changes no table)
                if len(self._stable) >= _MAX_LEARNED:
                    self._stable.clear()
                self._stable[key] = (epoch, spec)
            return spec
        return self.predict()

    def _seen(self) -> tuple[Ids | None, Ids, bool] | None:
        """What was seen to follow the last clean round (the last two, else the last), if anything."""
        last = self._last
        if last is None:
            return None
        seen = None if self._before is None else self._follows2.get((self._before, last))
        return self._follows.get(last) if seen is None else seen

    def expects_new(self) -> bool:
        """Whether the round armed after the last clean one is ``NEW``: a round of names the engine made up (an
        unnamed ``allreduce(t)`` after each barrier), which no ``Spec`` can carry (its names are new), and which
        the engine may expect by its layout instead (``spark_hvd.core.engine.fresh``)."""
        seen = self._seen()
        return seen is not None and seen[0] == NEW

    def predict(self) -> Spec | None:
        """The speculation for the round after the last clean one, if one is expected."""
        if self._last is None:
            return None
        seen = self._seen()
        if seen is None:  # nothing seen after this round yet: expect it again (a loop's next step), where a wrong
            # guess costs no more than the negotiation it stands in for (``NEW`` never comes again)
            if self._last == NEW or not self._guessable(self._last):
                return None
            spec = self._spec(self._last)
            return spec if spec is not None and _cheap_miss(spec) else None
        ids = seen[0]
        return None if not ids else self._spec(ids)  # (a ``NEW`` round next: nothing to speculate on)

    def _guessable(self, ids: Ids) -> bool:
        """Whether a round of ``ids`` may be guessed before it was seen to repeat (checked before its speculation
        is built: the staging of a large packed round is not allocated for a guess never made): barriers, or one
        allreduce that is small or carries the flag in its own collective (see ``_cheap_miss``)."""
        metas = [self._lookup(cache_id)[1] for cache_id in ids]
        if all(m.kind == "barrier" for m in metas):
            return True
        if len(metas) != 1 or metas[0].kind != "allreduce":
            return False
        nbytes = int(np.prod(metas[0].shape, dtype=np.int64)) * np.dtype(metas[0].dtype).itemsize
        return nbytes <= SPEC_BYTES or (self._in_band and self._size == 2)

    def _spec(self, ids: Ids) -> Spec | None:
        """The speculation on a round of ``ids`` (built once)."""
        if ids not in self._specs:
            if len(self._specs) >= _MAX_LEARNED:
                self._specs.clear()
                self._epoch += 1  # (the speculations remembered as stable transitions' are built anew)
            self._specs[ids] = build_spec(ids, self._lookup, self._size, self._fuses, self._staging,
                                          self._in_band, self._agrees_small)
        return self._specs[ids]

    def _staging(self, dtype: np.dtype, n: int) -> np.ndarray:
        """``n`` items of the shared scratch of ``dtype`` (replaced by a larger one when too small: speculations
        built before keep the old one alive until ``reset``)."""
        buf = self._scratch.get(dtype.str)
        if buf is None or buf.size < n:
            buf = self._scratch[dtype.str] = np.zeros(max(n, 2 * buf.size if buf is not None else 0), dtype)
        return buf[:n]

    def followed_by_new(self) -> Spec | None:
        """A round of names the engine made up (never submitted again) came after the last clean one: learnt as
        the round ``NEW``, so that what follows ``NEW`` (a barrier after each unnamed call) is predicted, and
        nothing is speculated on after a round that ``NEW`` follows. Returns the speculation for the next round."""
        self.steady = None
        if self._last is not None:
            self._epoch += _learn(self._follows, self._last, NEW)
            if self._before is not None:
                self._epoch += _learn(self._follows2, (self._before, self._last), NEW)
        self._before, self._last = self._last, NEW
        return self.predict()

    def forget_last(self) -> None:
        """Forget which rounds came last, keep what follows what (rounds went by unseen: a full negotiation that
        left the cache's ids as they were); the next clean round is predicted from at once."""
        self._last = self._before = self.steady = None

    def reset(self) -> None:
        """Forget every round (the cache may have changed: a full round)."""
        self._last = self._before = self.steady = None
        self._follows.clear()
        self._follows2.clear()
        self._specs.clear()
        self._scratch.clear()
        self._stable.clear()
        self._epoch += 1


def _cheap_miss(spec: Spec) -> bool:
    """Whether ``spec`` may be guessed before its round was seen to repeat: a round of one tensor or of barriers,
    whose miss costs no more than a round trip (a small packed round: one small collective; the flag in the data's
    own collective: a round trip, plus the early frames of a rank that guessed right while another did not). Not
    an in-place round (the whole tensor moves), a large packed one, nor several tensors (a training step's
    gradients may split into rounds differently each step)."""
    return spec.barrier or spec.in_band or (
        spec.sole is not None and not spec.in_place and spec.count * spec.dtype.itemsize <= SPEC_BYTES)


def _learn(follows: dict, key: object, now: Ids) -> bool:
    """Record that ``now`` followed ``key`` (a round, or the last two): the first successor seen is armed; one other
    round now and then keeps it armed; a second in a row disarms it until one successor is seen twice in a row.
    Returns whether that changed what ``follows`` holds."""
    seen = follows.get(key)
    if seen is None:
        learnt = (now, now, False)
    else:
        armed, previous, struck = seen
        if now == armed or now == previous or now == key:  # a round that repeats itself: a loop, armed at once
            learnt = (now, now, False)
        elif armed is not None and not struck:
            learnt = (armed, now, True)
        else:
            learnt = (None, now, False)
    if learnt == seen:
        return False
    follows[key] = learnt
    return True
