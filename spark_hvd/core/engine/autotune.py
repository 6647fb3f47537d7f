"""Autotune (Horovod's ``HOROVOD_AUTOTUNE``): the fusion threshold, the cycle time and, among three or more TCP
ranks (or hosts), the size from which allreduces take recursive halving-doubling, tuned online by rank 0, and
adopted only where paired measurements show them faster than the starting setting.

Thread-free and backend-free: the engine of rank 0 feeds its ``Tuner`` what every round reduced (the names and the
bytes) and the time; the tuner says which setting to run next (``pending``). The engine sends that choice to every
rank in the three tuning slots of the next fast round's vector (``spark_hvd.core.engine.table.fast_vector``), and every
rank, rank 0 included, switches at that round, before it runs the round's collectives: the ranks' fusion plans and
algorithms can never differ.

What a window measures. A *step* ends where a tensor name comes back (a training step's gradients, then the next
step's), or after ``MAX_STEP_NAMES`` names that never come back (unnamed allreduces); a *window* (Horovod's
sample) is ``steps_per_sample`` whole steps, begun at the first step boundary after the switch (so no window mixes
two settings). Its score is the median over its steps of each step's bytes allreduced per microsecond (Horovod's
unit, = MB/s), each step timed from the end of the round before it to the end of its last round: wall time, the
training's own compute included, which is what a setting should shorten. The median, not the window's mean, so that
a step stretched by something else (a preempted rank on a loaded host, a checkpoint) does not decide. The first
``warmup_samples`` windows are not scored (caches, first rounds, the JIT of a framework).

Paired against the start, so that drift cancels. Every window of a trial setting runs between two windows of the
starting setting (``baseline``: S c S c' S ...); the trial's *ratio* is its score over the geometric mean of its
two neighbours' scores. A load that rises or falls steadily over the three windows divides out, and no score is
ever compared with one measured minutes apart. On this project's 2-core machine one setting's scores varied
20-30% between windows; the ratios of neighbouring windows are what such noise leaves comparable.

The search proposes, the confirmation decides. A coordinate search over small grids (each including the starting
value), one paired window per point: the cycle times with the starting fusion threshold, then the fusion
thresholds with the best cycle time so far, then (where the backend's TCP allreduce runs among three or more ranks
or hosts, ``tune_algorithm``) the halving-doubling threshold (off, 256 KiB, 1 MiB, 4 MiB) with the best of both.
The point with the highest ratio, if above 1, is then *confirmed* on fresh windows: up to ``CONFIRM_PAIRS`` more
paired windows, stopping at the first whose ratio is not above 1. It is adopted only if every confirming ratio is
above 1 (a sign test: were it no faster than the start, with noise as likely to favour either, all
``CONFIRM_PAIRS`` would favour it with probability 2**-CONFIRM_PAIRS = 1/32) and their median is at least
``1 + MARGIN``; otherwise the job keeps the setting it started with. So the screening's noise can only cost a
missed gain, never a slower job: what the tuning can lose is its own windows (at most ``max_windows()``).
Horovod searches the same knobs by Bayesian optimisation (a Gaussian process over ~20 samples, each scored once);
with window-to-window noise larger than most settings' differences, a model fitted to single scores chases noise,
and its choice is never checked against the start. A grid of at most 14 points needs no model, its values are ones
a user can read and set by hand, and the decision rests on the paired test alone.

The log (``SPARK_HVD_AUTOTUNE_LOG``), written by rank 0 only, one CSV line per window, like Horovod's autotune
log: ``cycle_time_ms,tensor_fusion_threshold,halving_doubling_threshold,score,trial,ratio`` (the thresholds in MiB,
as Horovod logs the fusion threshold in MB, 0: halving-doubling off; ``trial``: ``warmup``, ``baseline``,
``cycle``, ``fusion``, ``algorithm`` or ``confirm``; ``ratio``: a trial window's paired ratio), then a ``best``
line with the setting kept (its ``ratio`` the median of the confirming ratios, 1 where the start is kept).

Elastic resets. A reset shuts the engine down and starts a new one in the same process (``hvd.elastic.run``
outside Spark): ``tuner_for`` hands the new engine the tuner of the same job, log and starting setting, which
goes on where it was (an unfinished search redoes only its interrupted pair, after a warm-up window; a finished
one sends its result to every rank at the first fast round) and appends to the log (a ``reset`` line). A relaunched
attempt (``SPARK_HVD_RUN_ATTEMPT`` > 0, new processes: ``run_elastic`` on Spark) reads the log that rank 0 of the
earlier attempt wrote, where it can: a ``best`` line there is adopted without tuning again; without one, the
search starts again, appending.
"""

from __future__ import annotations

import csv
import logging
import math
import os
import statistics
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple, TextIO

import numpy as np

from spark_hvd.core.jobenv import JobEnv
from spark_hvd.core.settings import Settings

logger = logging.getLogger(__name__)

MIB = 1024 * 1024
#: The cycle times tried (milliseconds), the starting one added.
CYCLE_GRID_MS = (0.5, 1.0, 2.0, 5.0, 10.0)
#: The fusion thresholds tried (bytes), the starting one added.
FUSION_GRID = (1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 128 * MIB)
#: The halving-doubling thresholds tried (bytes; 0: off), the starting one added.
HALVING_DOUBLING_GRID = (0, 256 * 1024, 1 * MIB, 4 * MIB)
#: Paired windows that confirm the search's best point (all must favour it).
CONFIRM_PAIRS = 5
#: How much faster (the median confirming ratio) the best point must be to replace the start.
MARGIN = 0.03
#: A step of names that never come back (unnamed allreduces) ends after this many.
MAX_STEP_NAMES = 64
#: The largest values the fast round's int32 slots carry (bytes + 1, microseconds + 1).
_SLOT_MAX = 2**31 - 2
HEADER = ("cycle_time_ms", "tensor_fusion_threshold", "halving_doubling_threshold", "score", "trial", "ratio")
_TRIALS = ("cycle", "fusion", "algorithm")


class Point(NamedTuple):
    """One setting of the tuned knobs."""

    fusion_threshold: int  # bytes
    cycle_time_ms: float
    halving_doubling_bytes: int = 0  # SPARK_HVD_HALVING_DOUBLING_BYTES (0: off)

    def encode(self) -> tuple[int, int, int]:
        """The three fast-round slots that carry it to every rank (0 in all: no change)."""
        return (min(int(self.fusion_threshold), _SLOT_MAX) + 1,
                min(int(round(self.cycle_time_ms * 1000.0)), _SLOT_MAX) + 1,
                min(int(self.halving_doubling_bytes), _SLOT_MAX) + 1)

    @staticmethod
    def decode(slots: tuple[int, ...]) -> Point | None:
        """The setting the summed fast-round slots carry (only rank 0 writes them), or None."""
        fusion, cycle, halving = (int(x) for x in slots)
        if not fusion or not cycle or not halving:
            return None
        return Point(fusion - 1, (cycle - 1) / 1000.0, halving - 1)


class Tuner:
    """Rank 0's search for the fusion threshold and cycle time (see the module's docstring).

    Args:
        start: the settings the job started with.
        warmup_samples: windows not scored at first.
        steps_per_sample: whole steps per window.
        log_path: the CSV log's path, or None.
        tune_algorithm: also search the halving-doubling threshold (the backend's TCP allreduce runs among three
            or more ranks or hosts, where it applies).
        cycle_grid, fusion_grid, halving_grid: the values tried (the starting ones are added).
        append: append to an existing log (a relaunched attempt's) instead of starting it afresh.
    """

    def __init__(self, start: Point, warmup_samples: int = 3, steps_per_sample: int = 10,
                 log_path: str | None = None, tune_algorithm: bool = False,
                 cycle_grid: Iterable[float] = CYCLE_GRID_MS, fusion_grid: Iterable[int] = FUSION_GRID,
                 halving_grid: Iterable[int] = HALVING_DOUBLING_GRID, append: bool = False) -> None:
        if steps_per_sample < 1:
            raise ValueError(f"autotune needs at least one step per sample, got {steps_per_sample}")
        start = _norm(start)  # as the slots carry it, so the tuner compares like with like
        self.start = start
        self.current = start
        self.pending: Point | None = None  # a setting to send to every rank at the next fast round
        self.done = False
        self.best: Point | None = None
        self._steps_per_sample = int(steps_per_sample)
        self._grids = {
            "cycle": sorted({start.cycle_time_ms, *(_norm(Point(0, float(c))).cycle_time_ms for c in cycle_grid)}),
            "fusion": sorted({start.fusion_threshold, *(_norm(Point(int(f), 0.0)).fusion_threshold
                                                        for f in fusion_grid)}),
            "algorithm": sorted({start.halving_doubling_bytes, *(_norm(Point(0, 0.0, int(h))).halving_doubling_bytes
                                                                 for h in halving_grid)}) if tune_algorithm else [],
        }
        #: the paired ratios of every trial point, by trial ("cycle", "fusion", "algorithm": screening; "confirm")
        self.ratios: dict[str, dict[Point, list[float]]] = {trial: {} for trial in (*_TRIALS, "confirm")}
        self._lead = start  # the best point screened so far (the start until one beats it)
        self._phase = -1  # index into _TRIALS; len(_TRIALS): confirming
        self._queue: list[tuple[Point, str]] = [(start, "warmup")] * max(int(warmup_samples), 0)
        self._queue.append((start, "baseline"))
        self._trial = "warmup"
        self._window: tuple[Point, str] = (start, "warmup")  # the window under way (or waiting for its switch)
        self._base: float | None = None  # the score of the last baseline window
        self._waiting: tuple[Point, str, float] | None = None  # a trial window waiting for its next baseline
        # the window under way
        self._measuring = True  # False between the end of a window and the switch to the next setting
        self._started = False  # a step boundary seen since the switch: the window runs
        self._step: set[str] = set()
        self._steps = 0
        self._bytes = 0  # of the step under way
        self._t0 = 0.0  # when the step under way began
        self._rates: list[float] = []  # each whole step's bytes per microsecond in the window under way
        self._last = 0.0
        self._log_path = log_path
        self._log: TextIO | None = None
        self._open_log(append)
        logger.info("autotune: tuning the cycle time over %s ms, the fusion threshold over %s MiB and the "
                    "halving-doubling threshold over %s MiB, from %s", self._grids["cycle"],
                    [f / MIB for f in self._grids["fusion"]], [h / MIB for h in self._grids["algorithm"]],
                    _show(start))
        self._next(boundary=False)

    # ------------------------------------------------------------------ what the engine calls

    def observe(self, names: Iterable[str], nbytes: int, now: float) -> None:
        """A round allreduced ``names`` (``nbytes`` in all), ending at ``now`` (``time.perf_counter()``)."""
        if self.done or not self._measuring:
            return
        boundary = False
        for name in names:
            if name in self._step:
                boundary = True
                break
        if not boundary and len(self._step) >= MAX_STEP_NAMES:
            boundary = True
        if boundary:
            self._step.clear()
            if self._started:
                self._steps += 1
                self._rates.append(self._bytes / max((self._last - self._t0) * 1e6, 1e-9))
                self._t0, self._bytes = self._last, 0
                if self._steps >= self._steps_per_sample:
                    self._window_done(statistics.median(self._rates))
                    if not self._measuring or self.done:
                        return
            else:
                self._begin(True)
        self._step.update(names)
        if self._started:
            self._bytes += nbytes
        self._last = now

    def applied(self, point: Point, now: float) -> None:
        """Every rank switched to ``point`` in the round that ended at ``now``: measure it from the next step."""
        self.current = point
        if self.pending == point:
            self.pending = None
        self._measuring = not self.done
        self._begin(False)
        self._step.clear()
        self._last = now

    def close(self) -> None:
        """Close the log."""
        if self._log is not None:
            self._log.close()
            self._log = None

    def resume(self) -> None:
        """The job was reset: a new engine starts from ``start`` again. A finished tuner sends its result at the
        first fast round; an unfinished one redoes its interrupted pair after a warm-up window. Appends to the log."""
        self.current = self.start
        self.pending = None
        self._open_log(True)
        self._write(self.start, None, "reset", None)
        self._begin(False)
        self._step.clear()
        if self.done:
            self._measuring = False
            if self.best is not None and self.best != self.start:
                self.pending = self.best
            return
        point, trial = self._window
        if self._waiting is not None:  # its second neighbour was never measured: measure the pair again
            point, trial, _ = self._waiting
            self._waiting = None
        if trial not in ("warmup", "baseline"):
            self._queue[:0] = [(point, trial), (self.start, "baseline")]
        self._base = None
        self._queue[:0] = [(self.start, "warmup"), (self.start, "baseline")]
        self._measuring = True
        self._next(boundary=False)

    def adopt(self, best: Point) -> None:
        """End the tuning with ``best`` (an earlier attempt's result): every rank switches at the next fast round."""
        self._queue.clear()
        self.best, self.done, self._measuring = _norm(best), True, False
        self.pending = self.best if self.best != self.current else None
        self.close()

    def max_windows(self) -> int:
        """The most windows the tuning can take from now, warm-up excluded (the bound on what it can cost)."""
        points = sum(max(len(grid) - 1, 0) for grid in self._grids.values())
        return 1 + 2 * (points + CONFIRM_PAIRS)

    # ------------------------------------------------------------------ the search

    def _window_done(self, score: float) -> None:
        """Score the window just measured and choose what runs next."""
        self._begin(False)
        point, trial = self.current, self._trial
        if trial == "warmup":
            self._write(point, score, trial, None)
        elif trial == "baseline":
            waiting, self._waiting = self._waiting, None
            if waiting is not None:
                cpoint, ctrial, cscore = waiting
                ratio = cscore / math.sqrt(self._base * score) if self._base else cscore / score
                self.ratios[ctrial].setdefault(cpoint, []).append(ratio)
                self._write(cpoint, cscore, ctrial, ratio)
                logger.info("autotune: %s scored %.3f, %.3fx the start (%s)", _show(cpoint), cscore, ratio, ctrial)
                if ctrial == "confirm" and ratio <= 1.0:
                    self._queue.clear()  # the sign test cannot pass any more
            self._base = score
            self._write(point, score, trial, None)
        else:
            self._waiting = (point, trial, score)
        self._next()

    def _next(self, boundary: bool = True) -> None:
        """Run the next window of the queue, planning the next phase when the queue is empty; it begins at this
        step boundary (``boundary``: the last window just ended) or at the next one."""
        while not self._queue:
            self._phase += 1
            if self._phase < len(_TRIALS):
                self._plan_phase(_TRIALS[self._phase])
            elif self._phase == len(_TRIALS):
                self._lead = self._screened_best()
                if self._lead != self.start:
                    self._queue = [(self._lead, "confirm"), (self.start, "baseline")] * CONFIRM_PAIRS
            else:
                self._finish()
                return
        point, trial = self._window = self._queue.pop(0)
        self._trial = trial
        if point == self.current:  # no switch needed
            self._begin(boundary)
            return
        self.pending = point
        self._measuring = False

    def _begin(self, started: bool) -> None:
        """A new window: it runs from this step boundary (``started``) or waits for the next one."""
        self._started = started
        self._t0 = self._last
        self._steps = self._bytes = 0
        self._rates.clear()

    def _plan_phase(self, trial: str) -> None:
        """One paired window for every point of this coordinate's grid not screened yet, from the lead."""
        if self._phase > 0:  # the lead after the previous coordinate
            self._lead = self._screened_best()
        field = {"cycle": "cycle_time_ms", "fusion": "fusion_threshold", "algorithm": "halving_doubling_bytes"}[trial]
        seen = {p for ratios in self.ratios.values() for p in ratios}
        points = [self._lead._replace(**{field: v}) for v in self._grids[trial]]
        for point in points:
            if point != self.start and point not in seen:
                self._queue += [(point, trial), (self.start, "baseline")]

    def _screened_best(self) -> Point:
        best, best_ratio = self.start, 1.0
        for trial in _TRIALS:
            for point, ratios in self.ratios[trial].items():
                if statistics.median(ratios) > best_ratio:
                    best, best_ratio = point, statistics.median(ratios)
        return best

    def _finish(self) -> None:
        confirm = self.ratios["confirm"].get(self._lead, [])
        wins = len(confirm) == CONFIRM_PAIRS and min(confirm) > 1.0 and statistics.median(confirm) >= 1.0 + MARGIN
        best = self._lead if wins else self.start
        self.best = best
        self.done = True
        self._measuring = False
        ratio = statistics.median(confirm) if wins else 1.0
        self._write(best, None, "best", ratio)
        if self._lead == self.start:
            logger.info("autotune: done; no setting beat the start in the search: keeping %s", _show(best))
        else:
            logger.info("autotune: done; %s was %s in the confirming pairs %s: keeping %s", _show(self._lead),
                        "faster" if wins else "not faster by the margin", [round(r, 3) for r in confirm],
                        _show(best))
        self.close()
        if best != self.current:
            self.pending = best

    # ------------------------------------------------------------------ the log

    def _open_log(self, append: bool) -> None:
        if not self._log_path or self._log is not None:
            return
        path = self._log_path
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            fresh = not append or not os.path.exists(path) or os.path.getsize(path) == 0
            self._log = open(path, "w" if fresh else "a", encoding="utf-8")  # noqa: SIM115 - kept open
        except OSError as exc:
            raise ValueError(f"SPARK_HVD_AUTOTUNE_LOG={path!r}: cannot write the autotune log there: {exc}") from None
        if fresh:
            self._log.write(",".join(HEADER) + "\n")
            self._log.flush()

    def _write(self, point: Point, score: float | None, trial: str, ratio: float | None) -> None:
        if self._log is not None:
            self._log.write(f"{point.cycle_time_ms:g},{point.fusion_threshold / MIB:g},"
                            f"{point.halving_doubling_bytes / MIB:g},{'' if score is None else f'{score:.6g}'},"
                            f"{trial},{'' if ratio is None else f'{ratio:.4f}'}\n")
            self._log.flush()


# ---------------------------------------------------------------------- across elastic resets

#: The tuners of this process, by (job id, log path, starting setting): what a reset's new engine goes on with.
_tuners: dict[tuple[str, str | None, Point], Tuner] = {}


def tuner_for(start: Point, warmup_samples: int, steps_per_sample: int, log_path: str | None, *,
              tune_algorithm: bool, job_id: str = "", attempt: int = 0) -> Tuner:
    """Rank 0's tuner for a new engine: the one this process already ran for the same job, log and starting
    setting (resumed: an elastic reset), or, in a relaunched attempt, one that adopts the ``best`` line of the
    earlier attempt's log, or a new one (see the module's docstring)."""
    key = (job_id, log_path, _norm(start))
    tuner = _tuners.get(key)
    if tuner is not None:
        tuner.resume()
        return tuner
    best = read_best(log_path) if attempt > 0 and log_path else None
    tuner = Tuner(start, warmup_samples, steps_per_sample, log_path, tune_algorithm, append=attempt > 0)
    if attempt > 0:
        tuner._write(tuner.start, None, "reset", None)
    if best is not None:
        tuner.adopt(best)
        logger.info("autotune: attempt %d goes on with the earlier attempt's %s", attempt, _show(best))
    _tuners[key] = tuner
    return tuner


def read_best(log_path: str) -> Point | None:
    """The setting on the last ``best`` line of an autotune log, or None (no log, no such line)."""
    try:
        with open(log_path, newline="", encoding="utf-8") as f:
            rows = [row for row in csv.DictReader(f) if row.get("trial") == "best"]
    except OSError:
        return None
    if not rows:
        return None
    row = rows[-1]
    try:
        return _norm(Point(int(float(row["tensor_fusion_threshold"]) * MIB), float(row["cycle_time_ms"]),
                           int(float(row["halving_doubling_threshold"]) * MIB)))
    except (TypeError, ValueError):
        return None


def _norm(point: Point) -> Point:
    """``point`` as the fast round's slots carry it (whole bytes and microseconds)."""
    decoded = Point.decode(point.encode())
    assert decoded is not None
    return decoded


def _show(point: Point) -> str:
    halving = f"{point.halving_doubling_bytes / MIB:g} MiB" if point.halving_doubling_bytes else "off"
    return (f"cycle time {point.cycle_time_ms:g} ms, fusion threshold {point.fusion_threshold / MIB:g} MiB, "
            f"halving-doubling {halving}")


def job_tuner(settings: Settings, tunables: Mapping[str, int], job: JobEnv | None) -> Tuner:
    """Rank 0's tuner for the job's engine (``tuner_for``): from ``settings`` and the backend's own ``tunables``
    (``Backend.tunables``: the halving-doubling threshold is searched only where the backend offers it), for the
    job and attempt of the launch contract ``job`` (an elastic reset's new engine goes on with the same tuner)."""
    halving = tunables.get("halving_doubling_bytes", settings.halving_doubling_bytes)
    return tuner_for(Point(settings.fusion_threshold, settings.cycle_time_ms, halving),
                     settings.autotune_warmup_samples, settings.autotune_steps_per_sample, settings.autotune_log,
                     tune_algorithm="halving_doubling_bytes" in tunables, job_id=job.job_id if job else "",
                     attempt=job.attempt if job else 0)


def allreduced(ready: Iterable[tuple[Any, Any]]) -> tuple[list[str], int]:
    """The names and bytes of the allreduces among a round's ready ``(entry, mismatch)`` pairs (what it reduced)."""
    names, nbytes = [], 0
    for entry, error in ready:
        meta = entry.meta
        if error is None and meta.kind == "allreduce":
            names.append(entry.name)
            nbytes += math.prod(meta.shape) * np.dtype(meta.dtype).itemsize
    return names, nbytes
