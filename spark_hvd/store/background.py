"""Store writes off the training thread: ``BackgroundWriter`` runs them in order on one thread, retried.

A training process snapshots a checkpoint to its local disk (fast), hands the upload to the writer and goes on
training; the upload commits as every checkpoint does (files, then the manifest last, :mod:`spark_hvd.store.atomic`),
so a process lost mid-upload leaves the previous checkpoint as the newest committed one.

- At most one checkpoint is queued or in flight: a second ``submit(..., checkpoint=True)`` waits for it
  (``when_busy="wait"``) or is skipped (``"skip"``: ``submit`` returns False and the caller drops its snapshot).
  Other writes (a metrics log) queue behind it without waiting, so they stay in order with the checkpoints.
- A failed write is logged and retried (``retries`` times, with a growing pause). A checkpoint (or another write
  submitted ``optional``, such as a metrics log the next one rewrites) that still fails is skipped with a warning
  naming it and the error: a store outage longer than the retries must not end a long fit. Training goes on, the
  next checkpoint is written as usual, and the last committed one stays the recovery point (an upload commits
  atomically: a failed one leaves nothing committed, :mod:`spark_hvd.store.atomic`). ``skipped_failures`` counts
  them. Any other write that still fails is logged as an error and raised by the next ``submit`` or ``wait``,
  never dropped silently.
- ``write_with_retries`` is for the write that cannot be skipped (the final model): more retries, a longer pause
  doubling up to a bound, then ``UploadFailedError`` naming it.
- ``wait()`` returns once every submitted write is done (the end of a fit calls it before the final model).
- ``background=False`` runs every write in the caller's thread (the synchronous mode), with the same retries.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: Seconds ``wait`` allows by default for the writes still queued (an upload of many GB may need longer: pass it).
WAIT_TIMEOUT_S = 3600.0
#: ``write_with_retries``' defaults: 8 tries, pauses of 2, 4, 8, 16, 30, 30, 30 s (about 2 minutes of outage).
FINAL_RETRIES = 7
FINAL_PAUSE_S = 2.0
FINAL_MAX_PAUSE_S = 30.0


class UploadFailedError(RuntimeError):
    """A background store write failed after its retries (the message names it and the last error)."""


def write_with_retries(write: Callable[[], None], what: str, retries: int = FINAL_RETRIES,
                       pause_s: float = FINAL_PAUSE_S, max_pause_s: float = FINAL_MAX_PAUSE_S) -> None:
    """``write()``, retried ``retries`` times after a pause doubling from ``pause_s`` up to ``max_pause_s``; then
    ``UploadFailedError`` naming ``what`` and the last error."""
    for attempt in range(retries + 1):
        try:
            write()
            return
        except Exception as exc:
            if attempt >= retries:
                raise UploadFailedError(f"{what} failed {attempt + 1} times: {type(exc).__name__}: {exc}") from exc
            pause = min(max_pause_s, pause_s * (2 ** attempt))
            logger.warning("%s failed (try %d of %d), retrying in %.1f s: %s: %s", what, attempt + 1, retries + 1,
                           pause, type(exc).__name__, exc)
            time.sleep(pause)


class BackgroundWriter:
    """One thread running store writes in submission order (see the module docstring)."""

    def __init__(self, *, background: bool = True, when_busy: str = "wait", retries: int = 3,
                 retry_pause_s: float = 1.0, name: str = "spark_hvd-upload") -> None:
        if when_busy not in ("wait", "skip"):
            raise ValueError(f"when_busy must be 'wait' or 'skip', not {when_busy!r}")
        self.background = background
        self.when_busy = when_busy
        self.retries = max(0, int(retries))
        self.retry_pause_s = retry_pause_s
        self.name = name
        self.skipped = 0
        #: optional writes (checkpoints) that failed after their retries and were skipped
        self.skipped_failures = 0
        self._queue: queue.Queue = queue.Queue()
        self._idle = threading.Condition()
        self._pending = 0
        self._checkpoint_pending = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # ---- caller side
    def submit(self, write: Callable[[], None], *, what: str, checkpoint: bool = False,
               cleanup: Callable[[], None] | None = None, optional: bool | None = None) -> bool:
        """Run ``write()`` (described by ``what`` in logs: name the store path); ``cleanup()`` runs after it,
        whatever the outcome.

        ``checkpoint``: at most one such write is queued or running; when one is, wait for it or (``when_busy=
        "skip"``) return False without running ``write`` (``cleanup`` is not called either: the caller still owns
        what it would have cleaned). ``optional`` (default: ``checkpoint``): a failure after the retries is
        skipped with a warning, not raised. Raises ``UploadFailedError`` when an earlier write that was not
        optional failed for good.
        """
        optional = checkpoint if optional is None else optional
        self._raise_failed()
        if not self.background:
            try:
                self._run(write, what, optional)
            finally:
                if cleanup is not None:
                    cleanup()
            self._raise_failed()
            return True
        with self._idle:
            if checkpoint and self._checkpoint_pending:
                if self.when_busy == "skip":
                    self.skipped += 1
                    logger.info("%s: skipped (the previous checkpoint is still uploading)", what)
                    return False
                while self._checkpoint_pending:
                    self._idle.wait()
                self._raise_failed()
            self._pending += 1
            self._checkpoint_pending = self._checkpoint_pending or checkpoint
        self._start()
        self._queue.put((write, what, checkpoint, cleanup, optional))
        return True

    def busy(self) -> bool:
        """Whether a checkpoint is queued or uploading."""
        with self._idle:
            return self._checkpoint_pending

    def wait(self, timeout_s: float = WAIT_TIMEOUT_S) -> None:
        """Return once every submitted write is done; raise ``UploadFailedError`` if one failed for good, and
        ``TimeoutError`` naming how many are left after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.name}: {self._pending} store writes still running after "
                                       f"{timeout_s:g} s")
                self._idle.wait(min(left, 1.0))
        self._raise_failed()

    def close(self) -> None:
        """Stop the thread once the queue is drained (without waiting for it)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread = None

    # ---- worker side
    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            write, what, checkpoint, cleanup, optional = item
            try:
                self._run(write, what, optional)
            finally:
                try:
                    if cleanup is not None:
                        cleanup()
                finally:
                    with self._idle:
                        self._pending -= 1
                        if checkpoint:
                            self._checkpoint_pending = False
                        self._idle.notify_all()

    def _run(self, write: Callable[[], None], what: str, optional: bool = False) -> None:
        """``write()`` with retries; a final failure is skipped with a warning (``optional``), else logged and kept
        for ``_raise_failed``."""
        for attempt in range(self.retries + 1):
            try:
                write()
                return
            except Exception as exc:
                if attempt < self.retries:
                    pause = self.retry_pause_s * (2 ** attempt)
                    logger.warning("%s failed (try %d of %d), retrying in %.1f s: %s: %s", what, attempt + 1,
                                   self.retries + 1, pause, type(exc).__name__, exc)
                    time.sleep(pause)
                    continue
                if optional:
                    logger.warning("%s failed %d times; skipped, training goes on (the last committed checkpoint "
                                   "stays the recovery point; the next one is written as usual): %s: %s", what,
                                   attempt + 1, type(exc).__name__, exc)
                    with self._idle:
                        self.skipped_failures += 1
                    return
                logger.error("%s failed %d times; giving up: %s: %s", what, attempt + 1, type(exc).__name__, exc)
                with self._idle:
                    if self._error is None:
                        self._error = UploadFailedError(f"{what} failed {attempt + 1} times: "
                                                        f"{type(exc).__name__}: {exc}")
                        self._error.__cause__ = exc

    def _raise_failed(self) -> None:
        with self._idle:
            error = self._error
        if error is not None:
            raise error
