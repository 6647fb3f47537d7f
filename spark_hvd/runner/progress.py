"""Training progress: rank 0 reports its batches (``StepReporter``), the driver shows them (``ProgressDisplay``).

The convention on the wire is an ordinary ``report``: ``report(epoch=e, step=s, steps=n, epochs=m, loss=...)``
while an epoch runs (``s`` batches of ``n`` done), ``report(epoch=e, **metrics)`` when it ends.

On a terminal or in a notebook the driver shows a ``tqdm.auto`` bar per epoch (epoch, batches done of the epoch,
the last loss, ETA; the plain text bar in a notebook without ipywidgets), and when the epoch ends a line with every
metric, wrapped at 80 columns (Keras style: a bar's postfix is cut off at the terminal's edge); elsewhere (a log
file, a CI job) it prints one plain line per finished epoch. Epochs count from 1 on screen (reports and files count
from 0). ``verbose=0`` shows nothing; ``verbose=2`` prints every report as a line.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, TextIO

logger = logging.getLogger(__name__)

#: Metrics keys that describe progress rather than measure the model.
PROGRESS_KEYS = ("steps", "epochs")


def _number(value: Any) -> Any:
    """A plain float of a tensor / numpy scalar (only when a report is sent: no device sync per batch)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


class StepReporter:
    """Reports rank 0's batch progress to the driver at most every ``interval_s`` (always the first and the last
    batch).

    ``reporter(epoch, step, loss=...)``: ``step`` batches of ``steps`` are done in ``epoch``.
    """

    def __init__(self, steps: int, epochs: int | None = None, interval_s: float = 0.25) -> None:
        self.steps = int(steps)
        self.epochs = epochs
        self.interval_s = interval_s
        self._last: float | None = None

    def __call__(self, epoch: int, step: int, **metrics: Any) -> None:
        now = time.monotonic()
        if step < self.steps and self._last is not None and now - self._last < self.interval_s:
            return
        self._last = now
        from spark_hvd.runner.client import report

        extra = {"epochs": self.epochs} if self.epochs is not None else {}
        report(epoch=epoch, step=step, steps=self.steps, **extra,
               **{k: _number(v) for k, v in metrics.items()})


def _interactive(stream: TextIO) -> bool:
    """A terminal, or a Jupyter / Databricks notebook (whose output is no tty but renders a widget)."""
    try:
        if stream.isatty():
            return True
    except (AttributeError, ValueError):
        pass
    shell = sys.modules.get("IPython")
    if shell is None:
        return False
    try:
        ip = shell.get_ipython()
    except AttributeError:
        return False
    return ip is not None and type(ip).__name__ != "TerminalInteractiveShell" and "ipykernel" in sys.modules


def _format_metrics(metrics: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in metrics.items() if k not in PROGRESS_KEYS)


def phase_line(text: str, verbose: int = 1, stream: TextIO | None = None) -> None:
    """One ``[spark_hvd] <text>`` line on the driver for a phase of a run (preparing data, starting ranks,
    resuming), with ``verbose >= 1``: the word from spark_hvd between Spark's stage bars."""
    if verbose < 1:
        return
    out = stream or sys.stdout
    try:
        out.write(f"[spark_hvd] {text}\n")
        out.flush()
    except (OSError, ValueError):
        pass


#: the width an epoch's summary line is wrapped to (every metric stays visible on an 80-column terminal)
LINE_WIDTH = 80


def epoch_summary(prefix: str, metrics: dict[str, Any], width: int = LINE_WIDTH) -> str:
    """``prefix: k=v, k=v, ...`` wrapped at metric boundaries to ``width`` columns (continuations indented), so
    no metric is cut off as a bar's postfix is."""
    import textwrap

    text = _format_metrics(metrics)
    if not text:
        return prefix
    return textwrap.fill(text, width=width, initial_indent=prefix + ": ", subsequent_indent="    ",
                         break_long_words=False, break_on_hyphens=False)


def _tqdm_class() -> Any:
    """``tqdm.auto``'s bar, except in a notebook without ipywidgets, where that one warns (TqdmWarning: IProgress
    not found) and draws nothing: there the plain text bar."""
    import importlib.util

    if "ipykernel" in sys.modules and importlib.util.find_spec("ipywidgets") is None:
        from tqdm.std import tqdm
    else:
        from tqdm.auto import tqdm
    return tqdm


class ProgressDisplay:
    """The driver's view of a run's reports (see the module docstring).

    Args:
        verbose: 0 nothing; 1 rank 0's progress (a bar when ``interactive``, else a line per epoch); 2 every
            report as a line.
        stream: where it writes (default ``sys.stdout``, looked up at each write).
        interactive: force the bar on or off (default: ``stream`` is a terminal or a notebook).
    """

    def __init__(self, verbose: int = 1, stream: TextIO | None = None, interactive: bool | None = None) -> None:
        self.verbose = verbose
        self._stream = stream
        self.interactive = _interactive(self.stream) if interactive is None else interactive
        self._bar: Any = None
        self._bar_epoch: int | None = None
        self._epochs: int | None = None  # the run's epoch count, from its batch reports
        self._lock = threading.Lock()

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stdout

    # ------------------------------------------------------------------ events
    def show(self, event: Any) -> None:
        """Show one ``Event`` as ``verbose`` and the output kind ask."""
        if self.verbose < 1:
            return
        with self._lock:
            if isinstance(event.metrics.get("epochs"), int | float):
                self._epochs = int(event.metrics["epochs"])
            if self.verbose >= 2:
                self._line(event)
            elif event.rank != 0 or event.epoch is None:
                return
            elif self.interactive:
                try:
                    self._bar_update(event)
                except Exception:  # e.g. a notebook without ipywidgets: tqdm.notebook cannot draw its widget
                    logger.warning("spark_hvd: no progress bar here (%s); showing one line per epoch",
                                   sys.exc_info()[1])
                    self.interactive = False
                    self._bar = None
                    if event.step is None:
                        self._line(event)
            elif event.step is None:
                self._line(event)

    def write(self, text: str, stream: TextIO | None = None) -> None:
        """Print whole lines (ranks' output) without breaking an open bar."""
        out = stream or self.stream
        with self._lock:
            try:
                if self._bar is not None:
                    _tqdm_class().write(text.rstrip("\n"), file=out)
                else:
                    out.write(text)
                    out.flush()
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        """Close an open bar."""
        with self._lock:
            self._close_bar()

    # ------------------------------------------------------------------ internals
    def _epoch_name(self, epoch: int) -> str:
        """``epoch 3/10`` (on screen epochs count from 1; the store's files count from 0)."""
        return f"epoch {epoch + 1}/{self._epochs}" if self._epochs else f"epoch {epoch + 1}"

    def _line(self, event: Any) -> None:
        where = []
        if event.epoch is not None:
            where.append(self._epoch_name(event.epoch))
        if event.step is not None:
            where.append(f"step {event.step}")
        line = epoch_summary(f"[spark_hvd] rank {event.rank} {' '.join(where)}".rstrip(), event.metrics)
        try:
            if self._bar is not None:
                _tqdm_class().write(line, file=self.stream)
            else:
                self.stream.write(line + "\n")
                self.stream.flush()
        except (OSError, ValueError):
            pass

    def _bar_update(self, event: Any) -> None:
        tqdm = _tqdm_class()
        metrics = event.metrics
        if event.step is None and (self._bar is None or self._bar_epoch != event.epoch):
            self._close_bar()  # an epoch reported without its batches: a plain line
            self._line(event)
            return
        if self._bar is None or self._bar_epoch != event.epoch:
            self._close_bar()
            # initial: a bar opened by a report of step k starts at k, so those k batches do not count as done in
            # no time (the first frame shows no rate rather than 600000 batch/s); smoothing=0: the rate is the
            # average since that report, not the last frame's
            first = int(event.step) if event.step is not None else 0
            self._bar = tqdm(total=metrics.get("steps"), desc=self._epoch_name(event.epoch), unit="batch",
                             file=self.stream, leave=True, dynamic_ncols=True, initial=max(0, first),
                             smoothing=0)
            self._bar_epoch = event.epoch
        bar = self._bar
        if event.step is not None:
            bar.update(max(0, int(event.step) - bar.n))
            loss = metrics.get("loss")
            if isinstance(loss, float):
                bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
            bar.refresh()
        else:  # the epoch ended: the bar closes; every averaged metric goes on a line of its own (Keras style)
            if bar.total is not None:
                bar.update(max(0, bar.total - bar.n))
            self._close_bar()
            try:
                self.stream.write(epoch_summary(self._epoch_name(event.epoch), metrics) + "\n")
                self.stream.flush()
            except (OSError, ValueError):
                pass

    def _close_bar(self) -> None:
        if self._bar is not None:
            try:
                self._bar.close()
            except (OSError, ValueError):
                pass
            self._bar = None
            self._bar_epoch = None
