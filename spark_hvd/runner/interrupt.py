"""Ctrl-C during a training stage without Spark's noise: ``QuietInterrupt(spark)`` around the stage.

A SIGINT in the driver runs pyspark's handler, which cancels every job and raises ``KeyboardInterrupt``; the JVM
then logs a warning per killed task (``TaskSetManager: Lost task ... TaskKilled``, ``Incomplete task interrupted:
Attempting to kill Python Worker``) and one for the runner's own cancellation of a job group already gone, on the
console, after the user's own message. While the stage runs, the context manager puts a handler of its own in
front of pyspark's (main thread, classic session only): on SIGINT it first raises the loggers of those warnings to
``ERROR``, then hands over to the previous handler. The loggers get back their configuration when the block ends
(the runner ends it once the cancelled tasks have left their slots), and the stage's console progress bar is
cleared, so the ``KeyboardInterrupt`` starts on a line of its own. Warnings of a stage that is *not* interrupted are
never hidden.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

__all__ = ["NOISY_LOGGERS", "QuietInterrupt"]

logger = logging.getLogger(__name__)

#: the JVM loggers whose warnings a cancelled training stage brings (log4j names; their children follow them)
NOISY_LOGGERS = ("org.apache.spark.scheduler", "org.apache.spark.sql.execution.python", "org.apache.spark.api.python",
                 "org.apache.spark.executor.Executor")


class _Quieted:
    """The loggers set to ERROR on an interrupt, and how to give them back their configuration."""

    def __init__(self, jvm: Any) -> None:
        self.jvm = jvm
        self.added: list[str] = []  # logger configs this created (removed again)
        self.levels: dict[str, Any] = {}  # existing logger configs whose level this changed (restored)

    def quiet(self) -> None:
        log4j = self.jvm.org.apache.logging.log4j
        context = log4j.LogManager.getContext(False)
        config = context.getConfiguration()
        error = log4j.Level.ERROR
        for name in NOISY_LOGGERS:
            if name in self.added or name in self.levels:
                continue
            existing = config.getLoggerConfig(name)
            if existing.getName() == name:
                self.levels[name] = existing.getLevel()
                existing.setLevel(error)
            else:
                config.addLogger(name, log4j.core.config.LoggerConfig(name, error, True))
                self.added.append(name)
        context.updateLoggers()

    def restore(self) -> None:
        if not (self.added or self.levels):
            return
        log4j = self.jvm.org.apache.logging.log4j
        context = log4j.LogManager.getContext(False)
        config = context.getConfiguration()
        for name, level in self.levels.items():
            config.getLoggerConfig(name).setLevel(level)
        for name in self.added:
            config.removeLogger(name)
        context.updateLoggers()
        self.added, self.levels = [], {}


class QuietInterrupt:
    """While started, a SIGINT first silences Spark's cancellation warnings (module docstring), then raises as
    before. Does nothing outside the main thread, for Spark Connect, where SIGINT is not handled in Python, or
    where the JVM's logging is not log4j 2. ``start()`` / ``stop()``, or ``with QuietInterrupt(spark):``."""

    def __init__(self, spark: Any) -> None:
        classic = hasattr(spark, "_jsparkSession")
        self._jvm = getattr(getattr(spark, "sparkContext", None), "_jvm", None) if classic else None
        self._spark = spark
        self._previous: Any = None
        self._quieted: _Quieted | None = None

    def start(self) -> QuietInterrupt:
        """Put the handler in front of the current SIGINT handler."""
        if self._jvm is None or threading.current_thread() is not threading.main_thread():
            return self
        previous = signal.getsignal(signal.SIGINT)
        if not callable(previous):  # ignored, or not handled by Python: nothing to put in front of
            return self
        quieted = self._quieted = _Quieted(self._jvm)

        def on_sigint(signum: int, frame: Any) -> None:
            try:
                quieted.quiet()
            except Exception:  # noqa: BLE001 - never stand between the user and the interrupt
                logger.debug("could not quiet Spark's loggers", exc_info=True)
            previous(signum, frame)
            raise KeyboardInterrupt

        self._previous = previous
        signal.signal(signal.SIGINT, on_sigint)
        return self

    def stop(self) -> None:
        """Put the previous SIGINT handler back and give the loggers back their configuration."""
        if self._quieted is None:
            return
        signal.signal(signal.SIGINT, self._previous)
        for step in ((lambda: _clear_progress_bar(self._spark)) if self._quieted.added or self._quieted.levels
                     else (lambda: None), self._quieted.restore):  # interrupted: end the stage bar's line too
            try:
                step()
            except Exception:  # noqa: BLE001 - the JVM may be gone already
                logger.debug("could not restore Spark's console and loggers", exc_info=True)
        self._quieted = None

    def __enter__(self) -> QuietInterrupt:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _clear_progress_bar(spark: Any) -> None:
    """Clear the console progress bar of the cancelled stage (Spark clears it only after a job that succeeded), so
    what follows starts at the beginning of a line."""
    bar = spark.sparkContext._jsc.sc().progressBar()  # Option[ConsoleProgressBar]: None unless the bar is on
    if bar.isDefined():
        bar.get().finishAll()
