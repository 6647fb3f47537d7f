"""Autotune (Horovod's ``HOROVOD_AUTOTUNE``): the fusion threshold, the cycle time and, among three or more TCP
ranks (or hosts), the size from which allreduces take recursive halving-doubling, tuned online by rank 0.

Thread-free and backend-free: the engine of rank 0 feeds its ``Tuner`` what every round reduced (the names and the
bytes) and the time; the tuner scores each trial setting by throughput and says which setting to try next
(``pending``). The engine sends that choice to every rank in the three tuning slots of the next fast round's vector
(``spark_hvd.core.table.fast_vector``), and every rank, rank 0 included, switches at that round, before it runs the
round's collectives: the ranks' fusion plans and algorithms can never differ.

What a trial measures. A *step* ends where a tensor name comes back (a training step's gradients, then the next
step's), or after ``MAX_STEP_NAMES`` names that never come back (unnamed allreduces); a *sample* is
``steps_per_sample`` whole steps, begun at the first step boundary after the switch (so no sample mixes two
settings). Its score is the median over its steps of each step's bytes allreduced per microsecond (Horovod's unit,
= MB/s), each step timed from the end of the round before it to the end of its last round: wall time, the
training's own compute included, which is what a setting should shorten. The median, not the sample's mean, so
that a step stretched by something else (a preempted rank on a loaded host, a checkpoint) does not decide. The
first ``warmup_samples`` samples are not scored (caches, first rounds, the JIT of a framework).

The search, a coordinate descent over small grids (each including the starting value): every cycle time with the
starting fusion threshold, then every fusion threshold with the best cycle time, then (where the backend's TCP
allreduce runs among three or more ranks or hosts, ``tune_algorithm``) the halving-doubling threshold
(``SPARK_HVD_HALVING_DOUBLING_BYTES``: off, 256 KiB, 1 MiB, 4 MiB) with the best of both; then the best setting
and the starting one are measured again, alternately (``CONFIRM_SAMPLES`` each), and the best one is kept only if
the median of its samples beats the median of the starting setting's: noise under load cannot make the tuned job
slower than the untuned one by more than the scores could tell apart. Horovod searches the same two knobs with
Bayesian optimisation over ~20 samples (and whether to use its hierarchical algorithms); a grid of 14 points at
most, measured in the order above, needs no model and lands on values a user can read and set by hand.

The log (``SPARK_HVD_AUTOTUNE_LOG``), written by rank 0 only, one CSV line per scored sample, like Horovod's
autotune log: ``cycle_time_ms,tensor_fusion_threshold,halving_doubling_threshold,score,trial`` (the thresholds in
MiB, as Horovod logs the fusion threshold in MB, 0: halving-doubling off; ``trial``: ``cycle``, ``fusion``,
``algorithm`` or ``confirm``) and a last line with the setting kept (``best``).
"""

from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Iterable
from typing import NamedTuple, TextIO

logger = logging.getLogger(__name__)

MIB = 1024 * 1024
#: The cycle times tried (milliseconds), the starting one added.
CYCLE_GRID_MS = (0.5, 1.0, 2.0, 5.0, 10.0)
#: The fusion thresholds tried (bytes), the starting one added.
FUSION_GRID = (1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 128 * MIB)
#: The halving-doubling thresholds tried (bytes; 0: off), the starting one added.
HALVING_DOUBLING_GRID = (0, 256 * 1024, 1 * MIB, 4 * MIB)
#: Samples of the best and of the starting setting measured again before the best is kept.
CONFIRM_SAMPLES = 2
#: A step of names that never come back (unnamed allreduces) ends after this many.
MAX_STEP_NAMES = 64
#: The largest values the fast round's int32 slots carry (bytes + 1, microseconds + 1).
_SLOT_MAX = 2**31 - 2


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
        warmup_samples: samples not scored at first.
        steps_per_sample: whole steps per scored sample.
        log_path: the CSV log's path, or None.
        tune_algorithm: also search the halving-doubling threshold (the backend's TCP allreduce runs among three
            or more ranks or hosts, where it applies).
        cycle_grid, fusion_grid, halving_grid: the values tried (the starting ones are added).
    """

    def __init__(self, start: Point, warmup_samples: int = 3, steps_per_sample: int = 10,
                 log_path: str | None = None, tune_algorithm: bool = False,
                 cycle_grid: Iterable[float] = CYCLE_GRID_MS, fusion_grid: Iterable[int] = FUSION_GRID,
                 halving_grid: Iterable[int] = HALVING_DOUBLING_GRID) -> None:
        if steps_per_sample < 1:
            raise ValueError(f"autotune needs at least one step per sample, got {steps_per_sample}")
        start = _norm(start)  # as the slots carry it, so the tuner compares like with like
        self.start = start
        self.current = start
        self.pending: Point | None = None  # a setting to send to every rank at the next fast round
        self.done = False
        self.best: Point | None = None
        self._warmup = max(int(warmup_samples), 0)
        self._steps_per_sample = int(steps_per_sample)
        self._cycles = sorted({start.cycle_time_ms, *(_norm(Point(0, float(c))).cycle_time_ms for c in cycle_grid)})
        self._fusions = sorted({start.fusion_threshold, *(_norm(Point(int(f), 0.0)).fusion_threshold
                                                          for f in fusion_grid)})
        self._halvings = sorted({start.halving_doubling_bytes, *(_norm(Point(0, 0.0, int(h))).halving_doubling_bytes
                                                                 for h in halving_grid)}) if tune_algorithm else []
        self._scores: dict[Point, list[float]] = {}
        self._plan: list[tuple[Point, str]] = [(start._replace(cycle_time_ms=c), "cycle") for c in self._cycles]
        self._phase = "cycle"
        self._trial = "warmup"
        self._candidate: Point | None = None  # the best of the search, confirmed against the start
        # the sample under way
        self._measuring = True  # False between the end of a sample and the switch to the next setting
        self._started = False  # a step boundary seen since the switch: the sample runs
        self._step: set[str] = set()
        self._steps = 0
        self._bytes = 0  # of the step under way
        self._t0 = 0.0  # when the step under way began
        self._rates: list[float] = []  # each whole step's bytes per microsecond in the sample under way
        self._last = 0.0
        self._log: TextIO | None = None
        if log_path:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
                self._log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - open for the tuner's lifetime
            except OSError as exc:
                raise ValueError(f"SPARK_HVD_AUTOTUNE_LOG={log_path!r}: cannot write the autotune log there: "
                                 f"{exc}") from None
            self._log.write("cycle_time_ms,tensor_fusion_threshold,halving_doubling_threshold,score,trial\n")
            self._log.flush()
        logger.info("autotune: tuning the cycle time over %s ms, the fusion threshold over %s MiB and the "
                    "halving-doubling threshold over %s MiB, from %s", self._cycles, [f / MIB for f in self._fusions],
                    [h / MIB for h in self._halvings], _show(start))
        if self._warmup == 0:
            self._next()

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
                    self._sample_done(statistics.median(self._rates))
                    if not self._measuring or self.done:
                        return
            else:
                self._restart()
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
        self._started = False
        self._step.clear()
        self._steps = self._bytes = 0
        self._rates.clear()
        self._last = now

    def close(self) -> None:
        """Close the log."""
        if self._log is not None:
            self._log.close()
            self._log = None

    # ------------------------------------------------------------------ the search

    def _sample_done(self, score: float) -> None:
        """Score the sample just measured and choose what runs next."""
        self._started = False
        self._steps = self._bytes = 0
        self._rates.clear()
        if self._trial == "warmup":
            self._warmup -= 1
            if self._warmup > 0:
                self._restart()  # the next sample, under the same setting, from this boundary
                return
            self._next()
            return
        self._scores.setdefault(self.current, []).append(score)
        self._write(self.current, score, self._trial)
        logger.info("autotune: %s scored %.3f (%s)", _show(self.current), score, self._trial)
        self._next()

    def _restart(self) -> None:
        """Begin a sample at this step boundary."""
        self._started = True
        self._t0 = self._last
        self._bytes = self._steps = 0
        self._rates.clear()

    def _next(self) -> None:
        """Run the next trial of the plan, planning the next phase when this one is over."""
        while not self._plan:
            if self._phase == "cycle":
                best = self._best_of(self._scores)
                self._plan = [(p, "fusion") for p in (best._replace(fusion_threshold=f) for f in self._fusions)
                              if p not in self._scores]
                self._phase = "fusion"
            elif self._phase == "fusion":
                best = self._best_of(self._scores)
                tries = (best._replace(halving_doubling_bytes=h) for h in self._halvings)
                self._plan = [(p, "algorithm") for p in tries if p not in self._scores]
                self._phase = "algorithm"
            elif self._phase == "algorithm":
                best = self._best_of(self._scores)
                self._phase = "confirm"
                if best != self.start:
                    self._candidate = best
                    self._plan = [(p, "confirm") for _ in range(CONFIRM_SAMPLES) for p in (best, self.start)]
            else:
                self._finish()
                return
        point, trial = self._plan.pop(0)
        self._trial = trial
        if point == self.current:
            self._restart()  # no switch needed: the next sample begins at this boundary
            return
        self.pending = point
        self._measuring = False

    def _best_of(self, scores: dict[Point, list[float]]) -> Point:
        return max(scores, key=lambda p: (statistics.median(scores[p]), p == self.start))

    def _finish(self) -> None:
        best, median = self.start, statistics.median
        candidate = self._candidate
        if candidate is not None and median(self._scores[candidate]) > median(self._scores.get(self.start, [0.0])):
            best = candidate
        self.best = best
        self.done = True
        self._measuring = False
        score = median(self._scores.get(best, [0.0]))
        self._write(best, score, "best")
        logger.info("autotune: done; keeping %s (median score %.3f)", _show(best), score)
        self.close()
        if best != self.current:
            self.pending = best

    def _write(self, point: Point, score: float, trial: str) -> None:
        if self._log is not None:
            self._log.write(f"{point.cycle_time_ms:g},{point.fusion_threshold / MIB:g},"
                            f"{point.halving_doubling_bytes / MIB:g},{score:.6g},{trial}\n")
            self._log.flush()


def _norm(point: Point) -> Point:
    """``point`` as the fast round's slots carry it (whole bytes and microseconds)."""
    decoded = Point.decode(point.encode())
    assert decoded is not None
    return decoded


def _show(point: Point) -> str:
    halving = f"{point.halving_doubling_bytes / MIB:g} MiB" if point.halving_doubling_bytes else "off"
    return (f"cycle time {point.cycle_time_ms:g} ms, fusion threshold {point.fusion_threshold / MIB:g} MiB, "
            f"halving-doubling {halving}")
