"""Task slots held by this driver process's runs, so concurrent ``run()`` calls share a session's slots.

``CrossValidator(parallelism=p)`` / ``TrainValidationSplit`` fit ``p`` estimators at once from a thread pool, and
each fit is a barrier stage of ``num_proc`` tasks. Spark would start a barrier stage only when all its tasks fit at
once, and the pre-launch slot check would fail a run whose slots are busy (after a grace of seconds): with
``p * num_proc`` above the slots, the later fits failed with ``NotEnoughSlotsError`` although the earlier ones
would soon give their slots back.

Here every run reserves its ``num_proc`` slots in a per-session ledger before it launches and gives them back when
it ends. A run that does not fit beside the runs already holding slots waits its turn (logging once that it waits
and for whom) until enough are given back: runs never hold more slots than the session has, so no barrier stage
oversubscribes a core or a GPU, and a run never waits for a run that waits for it (a reservation is all or
nothing, and only running stages hold one), so there is no deadlock. The slot check before a run
(``slots.check_slots``) lets a run through when the slots it lacks are held by this process's other runs. The wait
is bounded by ``SPARK_HVD_SLOT_QUEUE_WAIT`` seconds (default 3600), then ``NotEnoughSlotsError``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator

from spark_hvd.runner.errors import NotEnoughSlotsError

logger = logging.getLogger(__name__)

#: Seconds a run waits for this process's other runs to give back the slots it needs.
QUEUE_WAIT_S = float(os.environ.get("SPARK_HVD_SLOT_QUEUE_WAIT", "3600"))


class SlotLedger:
    """Slots reserved per session key (a Spark application id) by this process's running stages."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held: dict[str, dict[int, int]] = {}
        self._tokens = itertools.count()

    def held(self, key: str) -> int:
        """Slots the session's runs hold now."""
        with self._cond:
            return sum(self._held.get(key, {}).values())

    def busy(self) -> bool:
        """Whether any run of this process holds slots now."""
        with self._cond:
            return bool(self._held)

    def holders(self, key: str) -> int:
        """How many runs of the session hold slots now."""
        with self._cond:
            return len(self._held.get(key, {}))

    @contextlib.contextmanager
    def reserve(self, key: str, num_proc: int, total: int, what: str = "run",
                timeout_s: float | None = None) -> Iterator[None]:
        """Hold ``num_proc`` of the session's ``total`` slots for the block, first waiting (bounded) while the
        other runs hold too many for it to fit.

        Raises:
            NotEnoughSlotsError: ``num_proc`` > ``total``, or the other runs did not give back enough slots within
                ``timeout_s`` (default ``QUEUE_WAIT_S``).
        """
        if num_proc > total:
            raise NotEnoughSlotsError(num_proc, total, total)
        timeout_s = QUEUE_WAIT_S if timeout_s is None else timeout_s
        token = next(self._tokens)
        began = time.monotonic()
        told = False
        with self._cond:
            while True:
                held = self._held.setdefault(key, {})
                used = sum(held.values())
                if used + num_proc <= total:
                    held[token] = num_proc
                    break
                if not told:
                    logger.warning("spark_hvd %s: needs %d task slots; %d of the %d are held by %d other run(s) of "
                                   "this process (CrossValidator / TrainValidationSplit parallelism, threads): "
                                   "waiting for them to finish", what, num_proc, used, total, len(held))
                    told = True
                left = timeout_s - (time.monotonic() - began)
                if left <= 0:
                    raise NotEnoughSlotsError(num_proc, total - used, total)
                self._cond.wait(min(left, 5.0))
        if told:
            logger.warning("spark_hvd %s: got its %d task slots after waiting %.1f s", what, num_proc,
                           time.monotonic() - began)
        try:
            yield
        finally:
            with self._cond:
                held = self._held.get(key, {})
                held.pop(token, None)
                if not held:
                    self._held.pop(key, None)
                self._cond.notify_all()


#: The process's ledger.
LEDGER = SlotLedger()
